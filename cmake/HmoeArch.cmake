# Reads arch/cpu.json and arch/gpu.json (the single source of truth for targets) and
# provides helpers that add per-ISA and per-SM modules and record them in the manifest.

set(HMOE_ARCH_DIR "${PROJECT_SOURCE_DIR}/arch")
file(READ "${HMOE_ARCH_DIR}/cpu.json" HMOE_CPU_JSON)
file(READ "${HMOE_ARCH_DIR}/gpu.json" HMOE_GPU_JSON)
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS
             "${HMOE_ARCH_DIR}/cpu.json" "${HMOE_ARCH_DIR}/gpu.json")

# --- CPU --------------------------------------------------------------------------------
string(TOLOWER "${CMAKE_SYSTEM_PROCESSOR}" _proc)
if(_proc MATCHES "^(x86_64|amd64)$")
  set(HMOE_PROCESSOR x86_64)
elseif(_proc MATCHES "^(aarch64|arm64)$")
  set(HMOE_PROCESSOR aarch64)
else()
  message(FATAL_ERROR "hmoe: processor '${CMAKE_SYSTEM_PROCESSOR}' has no entry in arch/cpu.json")
endif()

string(JSON _nlevels LENGTH "${HMOE_CPU_JSON}" processors ${HMOE_PROCESSOR} levels)
math(EXPR _last "${_nlevels} - 1")
set(HMOE_CPU_LEVELS "")
foreach(i RANGE ${_last})
  string(JSON _name GET "${HMOE_CPU_JSON}" processors ${HMOE_PROCESSOR} levels ${i} name)
  string(JSON _nflags LENGTH "${HMOE_CPU_JSON}" processors ${HMOE_PROCESSOR} levels ${i} flags)
  set(_flags "")
  if(_nflags GREATER 0)
    math(EXPR _flast "${_nflags} - 1")
    foreach(j RANGE ${_flast})
      string(JSON _f GET "${HMOE_CPU_JSON}" processors ${HMOE_PROCESSOR} levels ${i} flags ${j})
      list(APPEND _flags "${_f}")
    endforeach()
  endif()
  list(APPEND HMOE_CPU_LEVELS ${_name})
  set(HMOE_CPU_FLAGS_${_name} "${_flags}")
endforeach()
list(GET HMOE_CPU_LEVELS 0 HMOE_CPU_BASELINE)
message(STATUS "hmoe: CPU levels for ${HMOE_PROCESSOR}: ${HMOE_CPU_LEVELS}")

# --- GPU --------------------------------------------------------------------------------
set(HMOE_GPU_SASS_portable "")
string(JSON _ntargets LENGTH "${HMOE_GPU_JSON}" targets)
math(EXPR _last "${_ntargets} - 1")
foreach(i RANGE ${_last})
  string(JSON _sm GET "${HMOE_GPU_JSON}" targets ${i} sm)
  list(APPEND HMOE_GPU_SASS_portable ${_sm})
endforeach()
string(JSON HMOE_GPU_PTX_portable GET "${HMOE_GPU_JSON}" ptx_target)
set(HMOE_GPU_SASS_sm90a 90a)
set(HMOE_GPU_PTX_sm90a "")

# HMOE_CUDA_ARCHS overrides the portable targets, e.g. "80,90" (PTX for the highest): from the
# environment at every configure (so unsetting it takes effect in an existing build
# directory), or from -DHMOE_CUDA_ARCHS=... when the environment does not set it.
set(HMOE_CUDA_ARCHS "" CACHE STRING "override arch/gpu.json SASS targets (env HMOE_CUDA_ARCHS wins)")
set(_archs "${HMOE_CUDA_ARCHS}")
if(DEFINED ENV{HMOE_CUDA_ARCHS})
  set(_archs "$ENV{HMOE_CUDA_ARCHS}")
endif()
if(_archs)
  string(REPLACE "," ";" HMOE_GPU_SASS_portable "${_archs}")
  list(SORT HMOE_GPU_SASS_portable COMPARE NATURAL)
  list(GET HMOE_GPU_SASS_portable -1 HMOE_GPU_PTX_portable)
endif()

# --- manifest -------------------------------------------------------------------------------
# Entries are collected as JSON fragments and written by hmoe_write_manifest().
set_property(GLOBAL PROPERTY HMOE_MANIFEST_ISA "")
set_property(GLOBAL PROPERTY HMOE_MANIFEST_KERNELS "")

function(_hmoe_json_list out)
  set(_items "")
  foreach(x ${ARGN})
    list(APPEND _items "\"${x}\"")
  endforeach()
  list(JOIN _items ", " _joined)
  set(${out} "[${_joined}]" PARENT_SCOPE)
endfunction()

# hmoe_add_isa_module(<prefix> LEVEL <level> SOURCES ...): one extension module per ISA,
# named <prefix>_<level>, compiled with that level's flags from arch/cpu.json.
function(hmoe_add_isa_module prefix)
  cmake_parse_arguments(A "" "LEVEL" "SOURCES" ${ARGN})
  set(_mod ${prefix}_${A_LEVEL})
  python_add_library(${_mod} MODULE WITH_SOABI ${A_SOURCES})
  target_link_libraries(${_mod} PRIVATE pybind11::headers)
  # Hidden symbols: two ISA builds of the same code must never bind to each other's copies.
  set_target_properties(${_mod} PROPERTIES CXX_VISIBILITY_PRESET hidden VISIBILITY_INLINES_HIDDEN ON)
  target_compile_options(${_mod} PRIVATE ${HMOE_CPU_FLAGS_${A_LEVEL}})
  target_compile_definitions(${_mod} PRIVATE HMOE_MODULE_NAME=${_mod} HMOE_ISA=${A_LEVEL}
                             HMOE_ISA_NAME="${A_LEVEL}")
  target_include_directories(${_mod} PRIVATE "${PROJECT_SOURCE_DIR}/cpp")
  install(TARGETS ${_mod} LIBRARY DESTINATION hmoe/_native)
  _hmoe_json_list(_fl ${HMOE_CPU_FLAGS_${A_LEVEL}})
  set_property(GLOBAL APPEND PROPERTY HMOE_MANIFEST_ISA
               "\"${_mod}\": {\"op\": \"${prefix}\", \"isa\": \"${A_LEVEL}\", \"module\": \"hmoe._native.${_mod}\", \"flags\": ${_fl}}")
endfunction()

# hmoe_add_cuda_module(<name> FAMILY portable|sm90a KERNELS k1 k2 SOURCES ...)
function(hmoe_add_cuda_module name)
  cmake_parse_arguments(A "" "FAMILY" "KERNELS;SOURCES" ${ARGN})
  set(_archs "")
  foreach(sm ${HMOE_GPU_SASS_${A_FAMILY}})
    list(APPEND _archs "${sm}-real")
  endforeach()
  if(HMOE_GPU_PTX_${A_FAMILY})
    list(APPEND _archs "${HMOE_GPU_PTX_${A_FAMILY}}-virtual")
  endif()
  python_add_library(${name} MODULE WITH_SOABI ${A_SOURCES})
  set_target_properties(${name} PROPERTIES CUDA_ARCHITECTURES "${_archs}"
                        CUDA_RUNTIME_LIBRARY Static)
  target_link_libraries(${name} PRIVATE pybind11::headers CUDA::cudart_static)
  target_compile_options(${name} PRIVATE ${HMOE_CPU_FLAGS_${HMOE_CPU_BASELINE}}
                         $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr>)
  target_compile_definitions(${name} PRIVATE HMOE_MODULE_NAME=${name})
  target_include_directories(${name} PRIVATE "${PROJECT_SOURCE_DIR}/cpp" "${PROJECT_SOURCE_DIR}/cuda")
  install(TARGETS ${name} LIBRARY DESTINATION hmoe/_native)
  _hmoe_json_list(_sass ${HMOE_GPU_SASS_${A_FAMILY}})
  _hmoe_json_list(_ptx ${HMOE_GPU_PTX_${A_FAMILY}})
  foreach(k ${A_KERNELS})
    set_property(GLOBAL APPEND PROPERTY HMOE_MANIFEST_KERNELS
                 "\"${k}/${A_FAMILY}\": {\"op\": \"${k}\", \"family\": \"${A_FAMILY}\", \"module\": \"hmoe._native.${name}\", \"sass\": ${_sass}, \"ptx\": ${_ptx}}")
  endforeach()
endfunction()

function(hmoe_write_manifest)
  get_property(_isa GLOBAL PROPERTY HMOE_MANIFEST_ISA)
  get_property(_kern GLOBAL PROPERTY HMOE_MANIFEST_KERNELS)
  list(JOIN _isa ",\n    " _isa_j)
  list(JOIN _kern ",\n    " _kern_j)
  execute_process(COMMAND git rev-parse --short=12 HEAD WORKING_DIRECTORY "${PROJECT_SOURCE_DIR}"
                  OUTPUT_VARIABLE _rev OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE _rc)
  if(NOT _rc EQUAL 0 OR NOT _rev)
    set(_rev "unknown")
  endif()
  execute_process(COMMAND git status --porcelain --untracked-files=no WORKING_DIRECTORY "${PROJECT_SOURCE_DIR}"
                  OUTPUT_VARIABLE _dirty OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(_dirty)
    set(_rev "${_rev}-dirty")
  endif()
  if(HMOE_WITH_CUDA)
    set(_cuda "\"${CMAKE_CUDA_COMPILER_VERSION}\"")
    set(_nvcc "\"${CMAKE_CUDA_COMPILER_ID} ${CMAKE_CUDA_COMPILER_VERSION}\"")
  else()
    set(_cuda "null")
    set(_nvcc "null")
  endif()
  string(TOUPPER "${CMAKE_BUILD_TYPE}" _bt)
  set(_cxxflags "${CMAKE_CXX_FLAGS} ${CMAKE_CXX_FLAGS_${_bt}}")
  string(STRIP "${_cxxflags}" _cxxflags)
  string(REPLACE "\"" "\\\"" _cxxflags "${_cxxflags}")
  set(_json "{
  \"schema_version\": 1,
  \"version\": \"${SKBUILD_PROJECT_VERSION}\",
  \"git_revision\": \"${_rev}\",
  \"processor\": \"${HMOE_PROCESSOR}\",
  \"build_type\": \"${CMAKE_BUILD_TYPE}\",
  \"cxx_compiler\": \"${CMAKE_CXX_COMPILER_ID} ${CMAKE_CXX_COMPILER_VERSION}\",
  \"cxx_flags\": \"${_cxxflags}\",
  \"cuda_version\": ${_cuda},
  \"cuda_compiler\": ${_nvcc},
  \"cuda_runtime\": \"static\",
  \"cpu_modules\": {
    ${_isa_j}
  },
  \"cuda_kernels\": {
    ${_kern_j}
  }
}
")
  file(WRITE "${PROJECT_BINARY_DIR}/build_info.json" "${_json}")
  install(FILES "${PROJECT_BINARY_DIR}/build_info.json" DESTINATION hmoe)
endfunction()
