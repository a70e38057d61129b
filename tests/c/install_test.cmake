# Installs the built library into a scratch prefix, then configures and builds a consumer that
# uses find_package(kvalloc) and one that uses pkg-config, and runs both.

# Runs the command after `what` and stops the test, naming `what`, if it fails.
function(must what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(rc)
    message(FATAL_ERROR "${what} failed")
  endif()
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)
must("cmake --install" ${CMAKE_COMMAND} --install ${BINARY_DIR} --prefix ${prefix})

set(consumer ${WORK_DIR}/consumer)
file(MAKE_DIRECTORY ${consumer})
# The consumer includes every public header (kvalloc_kv.h first, on its own, as an engine that
# only uses the KV manager would), and defines functions with the names of library internals
# (kv_evict, kv_take): an engine's own names must never be linked into the library's calls, nor
# clash with them, the static library included.
file(WRITE ${consumer}/main.c [=[
#include <kvalloc_kv.h>
#include <kvalloc_var.h>
#include <kvalloc.h>
#include <kvalloc_stats.h>
#include <stdint.h>
#include <stdio.h>
static int engine_calls;
uint32_t kv_evict(void *kv, uint32_t n);
uint32_t kv_evict(void *kv, uint32_t n) { (void)kv; engine_calls++; return n + 1000; }
int kv_take(void);
int kv_take(void) { return ++engine_calls; }
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
    kva_kv_config kc;
    kva_kv_config_init(&kc);
    kc.layers = 2, kc.kv_heads = 2, kc.head_dim = 64, kc.num_blocks = 64;
    kva_kv *kv;
    uint64_t key = 7;
    kva_kv_seq seq;
    uint32_t evicted = 0;
    if (st == KVA_OK) st = kva_kv_create(&kc, NULL, &kv);
    if (st == KVA_OK) {
        st = kva_kv_seq_allocate(kv, kc.block_tokens, &key, 1, NULL, 0, 0, 0, &seq, NULL);
        if (st == KVA_OK) st = kva_kv_seq_free(kv, seq); /* its block stays cached */
        if (st == KVA_OK) st = kva_kv_evict(kv, 1, &evicted);
        kva_kv_destroy(kv);
    }
    int ok = st == KVA_OK && evicted == 1 && engine_calls == 0 && KVA_SHM_ABI_MAJOR >= 1;
    printf("consumer: %s, evicted %u, engine's functions called %d times\n", kva_strerror(st), evicted,
           engine_calls);
    return ok ? 0 : 1;
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
must("configuring the find_package(kvalloc) consumer"
     ${CMAKE_COMMAND} -S ${consumer} -B ${consumer}/build -DCMAKE_PREFIX_PATH=${prefix})
must("building the consumer" ${CMAKE_COMMAND} --build ${consumer}/build)
foreach(exe consumer consumer_static)
  must(${exe} ${consumer}/build/${exe})
endforeach()

# The README's C example, as written there, builds against the installed prefix without a
# warning and does what its comments say.
file(READ ${SOURCE_DIR}/README.md readme)
string(REGEX MATCH "```c\n(#include <kvalloc.h>[^`]*)```" unused "${readme}")
if(NOT CMAKE_MATCH_1)
  message(FATAL_ERROR "no C example found in README.md")
endif()
file(WRITE ${consumer}/readme_example.c "${CMAKE_MATCH_1}")
file(GLOB installed_libdir ${prefix}/lib*)
must("building the README's C example with -Wall -Wextra -Werror"
     cc -Wall -Wextra -Werror ${consumer}/readme_example.c -I${prefix}/include -L${installed_libdir} -lkvalloc
     -Wl,-rpath,${installed_libdir} -o ${consumer}/readme_example)
execute_process(COMMAND ${consumer}/readme_example OUTPUT_VARIABLE said RESULT_VARIABLE rc)
if(rc OR NOT said STREQUAL "double free\n")
  message(FATAL_ERROR "the README's C example said '${said}' (status ${rc}), not 'double free'")
endif()

# pkg-config is part of the contract, so its absence fails the test (make test installs it).
find_program(PKG_CONFIG pkg-config)
if(NOT PKG_CONFIG)
  message(FATAL_ERROR "pkg-config is not installed; cannot test kvalloc.pc")
endif()

# Builds the consumer with the flags pkg-config gives for the kvalloc.pc in pcdir (and the
# pkg-config options after pcdir, such as --static), and runs it.
function(pkg_config_consumer what pcdir)
  set(ENV{PKG_CONFIG_PATH} ${pcdir})
  execute_process(COMMAND ${PKG_CONFIG} ${ARGN} --cflags --libs kvalloc OUTPUT_VARIABLE flags
                  OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE rc)
  if(rc)
    message(FATAL_ERROR "pkg-config does not know kvalloc (${what})")
  endif()
  separate_arguments(flags UNIX_COMMAND "${flags}")
  get_filename_component(libdir ${pcdir} DIRECTORY)
  must("building the pkg-config consumer (${what}, flags: ${flags})"
       cc ${consumer}/main.c ${flags} -Wl,-rpath,${libdir} -o ${consumer}/pc_consumer)
  must("the pkg-config consumer (${what})" ${consumer}/pc_consumer)
endfunction()

file(GLOB pcdir ${prefix}/lib*/pkgconfig)
pkg_config_consumer("as installed" ${pcdir})

# A static link takes what the archive needs from the .pc file's Libs.private alone (librt
# before glibc 2.34, see CMakeLists.txt): the installed .pc file beside the archive and no
# shared library, so that -lkvalloc can only mean the archive.
set(static_only ${WORK_DIR}/static_only)
file(GLOB archive ${prefix}/lib*/libkvalloc.a)
file(COPY ${prefix}/include/ DESTINATION ${static_only}/include)
file(COPY ${archive} ${pcdir}/kvalloc.pc DESTINATION ${static_only}/lib/pkgconfig)
file(RENAME ${static_only}/lib/pkgconfig/libkvalloc.a ${static_only}/lib/libkvalloc.a)
pkg_config_consumer("static, Libs.private" ${static_only}/lib/pkgconfig --static)

# Every symbol the shared library needs resolves in the libraries it names (the build links it
# with --no-undefined; this checks the installed file as the loader sees it).
file(GLOB shared_library ${prefix}/lib*/libkvalloc.so)
execute_process(COMMAND ldd -r ${shared_library} OUTPUT_VARIABLE ldd_out ERROR_VARIABLE ldd_err RESULT_VARIABLE rc)
if(rc OR "${ldd_out}${ldd_err}" MATCHES "undefined symbol")
  message(FATAL_ERROR "libkvalloc.so leaves symbols unresolved:\n${ldd_out}${ldd_err}")
endif()

# Where GNUInstallDirs puts libraries on Debian with prefix /usr: lib/<multiarch>, one level
# deeper than the build's. The .pc file must find its prefix from there.
include(${SOURCE_DIR}/cmake/kvalloc_pc.cmake)
set(deep ${WORK_DIR}/deep)
set(deep_libdir lib/x86_64-linux-gnu)
kvalloc_write_pc(${deep}/${deep_libdir}/pkgconfig/kvalloc.pc /usr ${deep_libdir} include 0)
file(COPY ${prefix}/include/ DESTINATION ${deep}/include)
file(GLOB libs ${prefix}/lib*/libkvalloc*)
file(COPY ${libs} DESTINATION ${deep}/${deep_libdir})
pkg_config_consumer("lib/<multiarch>" ${deep}/${deep_libdir}/pkgconfig)

# Every installed library defines only its API as global symbols: every one is a kva_ name (the
# torch allocator's, a kva_torch_ one, its copy of the library staying inside it).
find_program(NM nm REQUIRED)
function(check_only_api lib least pattern)
  if(lib MATCHES "\\.a$")
    execute_process(COMMAND ${NM} -g --defined-only ${lib} OUTPUT_VARIABLE symbols RESULT_VARIABLE rc)
  else()
    execute_process(COMMAND ${NM} -D --defined-only ${lib} OUTPUT_VARIABLE symbols RESULT_VARIABLE rc)
  endif()
  if(rc)
    message(FATAL_ERROR "nm ${lib} failed")
  endif()
  string(REGEX MATCHALL "[0-9a-f]+ [A-Za-z] [^\n]+" entries "${symbols}")
  list(LENGTH entries count)
  if(count LESS ${least})
    message(FATAL_ERROR "nm found only ${count} symbols in ${lib}")
  endif()
  foreach(entry ${entries})
    if(NOT entry MATCHES " ${pattern}[a-z0-9_]+$")
      message(FATAL_ERROR "${lib} defines a global symbol outside the API: ${entry}")
    endif()
  endforeach()
endfunction()
foreach(lib ${libs})
  if(IS_SYMLINK ${lib})
  elseif(lib MATCHES "libkvalloc_torch")
    check_only_api(${lib} 6 kva_torch_)
  else()
    check_only_api(${lib} 40 kva_)
  endif()
endforeach()

# Before 1.0 the soname carries the minor version: an engine built against 0.1 must not load 0.2.
find_program(READELF readelf REQUIRED)
file(GLOB shared ${prefix}/lib*/libkvalloc.so)
execute_process(COMMAND ${READELF} -d ${shared} OUTPUT_VARIABLE dynamic RESULT_VARIABLE rc)
if(rc OR NOT dynamic MATCHES "Library soname: \\[libkvalloc\\.so\\.([0-9.]+)\\]")
  message(FATAL_ERROR "no soname found in ${shared}")
endif()
set(soversion ${CMAKE_MATCH_1})
file(STRINGS ${SOURCE_DIR}/CMakeLists.txt project_line REGEX "^project\\(kvalloc VERSION")
string(REGEX MATCH "VERSION ([0-9]+)\\.([0-9]+)" unused "${project_line}")
if(CMAKE_MATCH_1 EQUAL 0)
  set(expected "0.${CMAKE_MATCH_2}")
else()
  set(expected "${CMAKE_MATCH_1}")
endif()
if(NOT soversion STREQUAL expected)
  message(FATAL_ERROR "soname version ${soversion}, expected ${expected}")
endif()

# Distributions build packages with link-time optimization (dpkg-buildflags on Debian and
# Ubuntu: -flto=auto -ffat-lto-objects). LTO objects carry their symbols in sections objcopy
# cannot localize, so the archive exported every internal function again (kv_evict...), and the
# consumer above, which defines one, failed to link against it. The library compiles its own
# objects without LTO whatever the flags.
set(lto ${WORK_DIR}/lto)
must("configuring the LTO build"
     ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${lto} -DCMAKE_BUILD_TYPE=Release
     "-DCMAKE_C_FLAGS=-O2 -flto=auto -ffat-lto-objects" -DKVA_BUILD_TESTS=OFF -DKVA_BUILD_TOOLS=OFF OUTPUT_QUIET)
must("the LTO build of the static library" ${CMAKE_COMMAND} --build ${lto} --target kvalloc_static OUTPUT_QUIET)
check_only_api(${lto}/libkvalloc.a 40 kva_)
must("linking the LTO build's archive into a consumer that defines kv_evict"
     cc -flto=auto ${consumer}/main.c -I${SOURCE_DIR}/libkvalloc/include ${lto}/libkvalloc.a -lpthread -lm -ldl
     -o ${consumer}/lto_consumer)
must("the LTO build's consumer" ${consumer}/lto_consumer)
