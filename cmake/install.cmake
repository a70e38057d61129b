# Installs the headers, both libraries, a pkg-config file and a CMake package so that an engine can
# `find_package(kvalloc)` and link `kvalloc::kvalloc`, or use `pkg-config --libs kvalloc`.
include(CMakePackageConfigHelpers)

install(TARGETS kvalloc kvalloc_static EXPORT kvallocTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(FILES libkvalloc/include/kvalloc.h libkvalloc/include/kvalloc_kv.h libkvalloc/include/kvalloc_var.h libkvalloc/include/kvalloc_stats.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT kvallocTargets NAMESPACE kvalloc:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/kvalloc)
# The PyTorch allocator, a library of its own that torch loads by path (kvalloc_torch.h): no
# link target, nothing to find_package.
install(TARGETS kvalloc_torch LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(FILES libkvalloc/torch/kvalloc_torch.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})

configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/kvallocConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/kvallocConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/kvalloc)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/kvallocConfigVersion.cmake
  COMPATIBILITY ${KVA_COMPATIBILITY})
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/kvallocConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/kvallocConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/kvalloc)

include(${CMAKE_CURRENT_LIST_DIR}/kvalloc_pc.cmake)
kvalloc_write_pc(${CMAKE_CURRENT_BINARY_DIR}/kvalloc.pc ${CMAKE_INSTALL_PREFIX} ${CMAKE_INSTALL_LIBDIR} ${CMAKE_INSTALL_INCLUDEDIR} ${PROJECT_VERSION})
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/kvalloc.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
