# kvalloc_write_pc(OUTPUT PREFIX LIBDIR INCLUDEDIR VERSION): writes kvalloc.pc, to be installed in
# PREFIX/LIBDIR/pkgconfig. With LIBDIR and INCLUDEDIR relative to the prefix (GNUInstallDirs'
# defaults) its paths are relative to the file itself (${pcfiledir}), so an installed tree still
# works when moved; the way back up to the prefix is counted from LIBDIR's depth, which
# GNUInstallDirs makes lib, lib64 or lib/<multiarch>. With either absolute, the paths are the
# absolute ones under PREFIX. Used by install.cmake, and by the install test with a deeper
# LIBDIR than the build's.
function(kvalloc_write_pc output prefix libdir includedir version)
  if(IS_ABSOLUTE "${libdir}" OR IS_ABSOLUTE "${includedir}")
    set(KVA_PC_PREFIX "${prefix}")
  else()
    set(root /kvalloc-prefix)
    file(RELATIVE_PATH up ${root}/${libdir}/pkgconfig ${root})
    set(KVA_PC_PREFIX "\${pcfiledir}/${up}")
  endif()
  foreach(dir libdir includedir)
    if(IS_ABSOLUTE "${${dir}}")
      set(KVA_PC_${dir} "${${dir}}")
    else()
      set(KVA_PC_${dir} "\${prefix}/${${dir}}")
    endif()
  endforeach()
  set(PROJECT_VERSION ${version})
  # What a static link needs besides the library (CMakeLists.txt sets it: librt before glibc 2.34).
  if(NOT DEFINED KVA_PC_LIBS_PRIVATE)
    set(KVA_PC_LIBS_PRIVATE "-lpthread -ldl")
  endif()
  configure_file(${CMAKE_CURRENT_FUNCTION_LIST_DIR}/kvalloc.pc.in ${output} @ONLY)
endfunction()
