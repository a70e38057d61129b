# Installs the built library into a scratch prefix, then configures and builds a consumer that
# uses find_package(kvalloc) and one that uses pkg-config, and runs both.
file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BINARY_DIR} --prefix ${prefix} RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "cmake --install failed")
endif()

set(consumer ${WORK_DIR}/consumer)
file(MAKE_DIRECTORY ${consumer})
file(WRITE ${consumer}/main.c [=[
#include <kvalloc.h>
#include <stdio.h>
int main(void) {
    kva_config cfg;
    kva_config_init(&cfg);
    kva_pool *pool;
    if (kva_pool_create(&cfg, &pool) != KVA_OK) return 1;
    void *p;
    kva_status st = kva_alloc(pool, 4096, &p);
    if (st == KVA_OK) st = kva_free(pool, p);
    if (st == KVA_OK) st = kva_check(pool);
    kva_pool_destroy(pool);
    printf("consumer: %s\n", kva_strerror(st));
    return st == KVA_OK ? 0 : 1;
}
]=])
file(WRITE ${consumer}/CMakeLists.txt [=[
cmake_minimum_required(VERSION 3.18)
project(consumer C)
find_package(kvalloc REQUIRED)
add_executable(consumer main.c)
target_link_libraries(consumer PRIVATE kvalloc::kvalloc)
add_executable(consumer_static main.c)
target_link_libraries(consumer_static PRIVATE kvalloc::kvalloc_static)
]=])
execute_process(COMMAND ${CMAKE_COMMAND} -S ${consumer} -B ${consumer}/build -DCMAKE_PREFIX_PATH=${prefix}
                RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "find_package(kvalloc) consumer failed to configure")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${consumer}/build RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "consumer failed to build")
endif()
foreach(exe consumer consumer_static)
  execute_process(COMMAND ${consumer}/build/${exe} RESULT_VARIABLE rc)
  if(rc)
    message(FATAL_ERROR "${exe} failed")
  endif()
endforeach()

# pkg-config is part of the contract, so its absence fails the test (make test installs it).
find_program(PKG_CONFIG pkg-config)
if(NOT PKG_CONFIG)
  message(FATAL_ERROR "pkg-config is not installed; cannot test kvalloc.pc")
endif()
  file(GLOB pcdir ${prefix}/lib*/pkgconfig)
  set(ENV{PKG_CONFIG_PATH} ${pcdir})
  execute_process(COMMAND ${PKG_CONFIG} --cflags --libs kvalloc OUTPUT_VARIABLE flags
                  OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE rc)
  if(rc)
    message(FATAL_ERROR "pkg-config does not know kvalloc")
  endif()
  separate_arguments(flags UNIX_COMMAND "${flags}")
  file(GLOB libdir ${prefix}/lib*)
  execute_process(COMMAND cc ${consumer}/main.c ${flags} -Wl,-rpath,${libdir} -o ${consumer}/pc_consumer
                  RESULT_VARIABLE rc)
  if(rc)
    message(FATAL_ERROR "pkg-config consumer failed to build")
  endif()
  execute_process(COMMAND ${consumer}/pc_consumer RESULT_VARIABLE rc)
  if(rc)
    message(FATAL_ERROR "pkg-config consumer failed")
  endif()
