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
# Families (kernel_families in gpu.json): each is one module named after it. HMOE_GPU_SASS_<f> and
# HMOE_GPU_PTX_<f> are its targets, HMOE_GPU_OPS_<f> its ops, HMOE_GPU_SRC_<f>_<op> their sources.
set(HMOE_GPU_TARGETS "")
string(JSON _ntargets LENGTH "${HMOE_GPU_JSON}" targets)
math(EXPR _last "${_ntargets} - 1")
foreach(i RANGE ${_last})
  string(JSON _sm GET "${HMOE_GPU_JSON}" targets ${i} sm)
  list(APPEND HMOE_GPU_TARGETS ${_sm})
endforeach()
set(HMOE_GPU_PTX_TARGETS "")
string(JSON _nptx LENGTH "${HMOE_GPU_JSON}" ptx_targets)
math(EXPR _last "${_nptx} - 1")
foreach(i RANGE ${_last})
  string(JSON _sm GET "${HMOE_GPU_JSON}" ptx_targets ${i})
  list(APPEND HMOE_GPU_PTX_TARGETS ${_sm})
endforeach()

# HMOE_CUDA_ARCHS overrides the targets of the 'targets' families, e.g. "80,90" (PTX for the
# highest only): from the environment at every configure (so unsetting it takes effect in an existing
# build directory), or from -DHMOE_CUDA_ARCHS=... when the environment does not set it.
set(HMOE_CUDA_ARCHS "" CACHE STRING "override arch/gpu.json SASS targets (env HMOE_CUDA_ARCHS wins)")
set(_archs "${HMOE_CUDA_ARCHS}")
if(DEFINED ENV{HMOE_CUDA_ARCHS})
  set(_archs "$ENV{HMOE_CUDA_ARCHS}")
endif()
if(_archs)
  string(REPLACE "," ";" HMOE_GPU_TARGETS "${_archs}")
  list(SORT HMOE_GPU_TARGETS COMPARE NATURAL)
  list(GET HMOE_GPU_TARGETS -1 HMOE_GPU_PTX_TARGETS)
endif()

set(HMOE_GPU_FAMILIES "")
string(JSON _nfam LENGTH "${HMOE_GPU_JSON}" kernel_families)
math(EXPR _last "${_nfam} - 1")
foreach(i RANGE ${_last})
  string(JSON _fam MEMBER "${HMOE_GPU_JSON}" kernel_families ${i})
  list(APPEND HMOE_GPU_FAMILIES ${_fam})
  string(JSON _sass GET "${HMOE_GPU_JSON}" kernel_families ${_fam} sass)
  if(_sass STREQUAL "targets")
    set(HMOE_GPU_SASS_${_fam} ${HMOE_GPU_TARGETS})
  elseif(_sass MATCHES "^arch_specific:(.+)$")
    set(HMOE_GPU_SASS_${_fam} ${CMAKE_MATCH_1})
  else()
    message(FATAL_ERROR "hmoe: arch/gpu.json: family ${_fam} has sass '${_sass}' (expected 'targets' or 'arch_specific:<sm>')")
  endif()
  string(JSON _ptx GET "${HMOE_GPU_JSON}" kernel_families ${_fam} ptx)
  set(HMOE_GPU_PTX_${_fam} "")
  if(_ptx)
    set(HMOE_GPU_PTX_${_fam} ${HMOE_GPU_PTX_TARGETS})
  endif()
  set(HMOE_GPU_OPS_${_fam} "")
  string(JSON _nops LENGTH "${HMOE_GPU_JSON}" kernel_families ${_fam} ops)
  if(_nops GREATER 0)
    math(EXPR _olast "${_nops} - 1")
    foreach(j RANGE ${_olast})
      string(JSON _op MEMBER "${HMOE_GPU_JSON}" kernel_families ${_fam} ops ${j})
      list(APPEND HMOE_GPU_OPS_${_fam} ${_op})
      string(JSON _nsrc LENGTH "${HMOE_GPU_JSON}" kernel_families ${_fam} ops ${_op})
      math(EXPR _slast "${_nsrc} - 1")
      set(HMOE_GPU_SRC_${_fam}_${_op} "")
      foreach(k RANGE ${_slast})
        string(JSON _src GET "${HMOE_GPU_JSON}" kernel_families ${_fam} ops ${_op} ${k})
        list(APPEND HMOE_GPU_SRC_${_fam}_${_op} ${_src})
      endforeach()
    endforeach()
  endif()
endforeach()

# --- manifest -------------------------------------------------------------------------------
# Entries are collected as JSON fragments and written by hmoe_write_manifest().
set_property(GLOBAL PROPERTY HMOE_MANIFEST_ISA "")
set_property(GLOBAL PROPERTY HMOE_MANIFEST_KERNELS "")
set_property(GLOBAL PROPERTY HMOE_MANIFEST_FAMILIES "")

function(_hmoe_json_list out)
  set(_items "")
  foreach(x ${ARGN})
    list(APPEND _items "\"${x}\"")
  endforeach()
  list(JOIN _items ", " _joined)
  set(${out} "[${_joined}]" PARENT_SCOPE)
endfunction()

# Compile options and include paths every native module shares.
function(_hmoe_native_target name)
  target_link_libraries(${name} PRIVATE pybind11::headers)
  target_include_directories(${name} PRIVATE "${PROJECT_SOURCE_DIR}/include" "${PROJECT_SOURCE_DIR}/cpp")
  target_compile_definitions(${name} PRIVATE HMOE_MODULE_NAME=${name})
  # Hidden symbols: two builds of the same code (ISA levels, families) never bind to each other.
  set_target_properties(${name} PROPERTIES CXX_VISIBILITY_PRESET hidden VISIBILITY_INLINES_HIDDEN ON
                        CUDA_VISIBILITY_PRESET hidden)
  install(TARGETS ${name} LIBRARY DESTINATION hmoe/_native)
endfunction()

# hmoe_add_isa_module(<prefix> LEVEL <level> SOURCES ...): one extension module per ISA,
# named <prefix>_<level>, compiled with that level's flags from arch/cpu.json.
function(hmoe_add_isa_module prefix)
  cmake_parse_arguments(A "" "LEVEL" "SOURCES" ${ARGN})
  set(_mod ${prefix}_${A_LEVEL})
  python_add_library(${_mod} MODULE WITH_SOABI ${A_SOURCES} "${PROJECT_SOURCE_DIR}/cpp/bind/tensors.cpp")
  _hmoe_native_target(${_mod})
  target_compile_options(${_mod} PRIVATE ${HMOE_CPU_FLAGS_${A_LEVEL}})
  target_compile_definitions(${_mod} PRIVATE HMOE_ISA=${A_LEVEL} HMOE_ISA_NAME="${A_LEVEL}")
  _hmoe_json_list(_fl ${HMOE_CPU_FLAGS_${A_LEVEL}})
  set_property(GLOBAL APPEND PROPERTY HMOE_MANIFEST_ISA
               "\"${_mod}\": {\"op\": \"${prefix}\", \"isa\": \"${A_LEVEL}\", \"module\": \"hmoe._native.${_mod}\", \"flags\": ${_fl}}")
endfunction()

# hmoe_add_cuda_family(<family>): the family's module (named after it) from the ops gpu.json lists
# for it, SASS for its targets and PTX where it has one; a family without ops builds nothing and
# the manifest says so.
function(hmoe_add_cuda_family fam)
  _hmoe_json_list(_sass ${HMOE_GPU_SASS_${fam}})
  _hmoe_json_list(_ptx ${HMOE_GPU_PTX_${fam}})
  _hmoe_json_list(_ops ${HMOE_GPU_OPS_${fam}})
  if(NOT HMOE_GPU_OPS_${fam})
    message(STATUS "hmoe: CUDA family ${fam}: no kernels yet, no module")
    set_property(GLOBAL APPEND PROPERTY HMOE_MANIFEST_FAMILIES
                 "\"${fam}\": {\"module\": null, \"ops\": [], \"sass\": ${_sass}, \"ptx\": ${_ptx}}")
    return()
  endif()
  set(_srcs "${PROJECT_SOURCE_DIR}/cuda/family_binding.cpp" "${PROJECT_SOURCE_DIR}/cpp/bind/tensors.cpp")
  set(_defs "")
  foreach(op ${HMOE_GPU_OPS_${fam}})
    foreach(src ${HMOE_GPU_SRC_${fam}_${op}})
      list(APPEND _srcs "${PROJECT_SOURCE_DIR}/cuda/${src}")
    endforeach()
    list(APPEND _defs HMOE_HAS_${op}=1)
  endforeach()
  list(REMOVE_DUPLICATES _srcs)  # ops that share sources (ragged_prefill, paged_prefill)
  set(_archs "")
  foreach(sm ${HMOE_GPU_SASS_${fam}})
    list(APPEND _archs "${sm}-real")
  endforeach()
  foreach(sm ${HMOE_GPU_PTX_${fam}})
    list(APPEND _archs "${sm}-virtual")
  endforeach()
  python_add_library(${fam} MODULE WITH_SOABI ${_srcs})
  _hmoe_native_target(${fam})
  set_target_properties(${fam} PROPERTIES CUDA_ARCHITECTURES "${_archs}" CUDA_RUNTIME_LIBRARY Static)
  target_link_libraries(${fam} PRIVATE CUDA::cudart_static)
  target_compile_options(${fam} PRIVATE ${HMOE_CPU_FLAGS_${HMOE_CPU_BASELINE}}
                         $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr>)
  target_compile_definitions(${fam} PRIVATE ${_defs})
  target_include_directories(${fam} PRIVATE "${PROJECT_SOURCE_DIR}/cuda")
  # Every CUDA compile through cmake/ptxas_guard.py (ptxas's wgmma serialisation notes fail it),
  # before any launcher the build was given (ccache).
  set(_launch "${Python_EXECUTABLE}" "${PROJECT_SOURCE_DIR}/cmake/ptxas_guard.py")
  list(APPEND _launch ${CMAKE_CUDA_COMPILER_LAUNCHER})
  set_target_properties(${fam} PROPERTIES CUDA_COMPILER_LAUNCHER "${_launch}")
  message(STATUS "hmoe: CUDA family ${fam}: ${HMOE_GPU_OPS_${fam}}; SASS ${HMOE_GPU_SASS_${fam}}; PTX ${HMOE_GPU_PTX_${fam}}")
  set_property(GLOBAL APPEND PROPERTY HMOE_MANIFEST_FAMILIES
               "\"${fam}\": {\"module\": \"hmoe._native.${fam}\", \"ops\": ${_ops}, \"sass\": ${_sass}, \"ptx\": ${_ptx}}")
  foreach(k ${HMOE_GPU_OPS_${fam}})
    set_property(GLOBAL APPEND PROPERTY HMOE_MANIFEST_KERNELS
                 "\"${k}/${fam}\": {\"op\": \"${k}\", \"family\": \"${fam}\", \"module\": \"hmoe._native.${fam}\", \"sass\": ${_sass}, \"ptx\": ${_ptx}}")
  endforeach()
endfunction()

function(hmoe_write_manifest)
  get_property(_isa GLOBAL PROPERTY HMOE_MANIFEST_ISA)
  get_property(_kern GLOBAL PROPERTY HMOE_MANIFEST_KERNELS)
  get_property(_fams GLOBAL PROPERTY HMOE_MANIFEST_FAMILIES)
  list(JOIN _isa ",\n    " _isa_j)
  list(JOIN _kern ",\n    " _kern_j)
  list(JOIN _fams ",\n    " _fams_j)
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
  },
  \"cuda_families\": {
    ${_fams_j}
  }
}
")
  file(WRITE "${PROJECT_BINARY_DIR}/build_info.json" "${_json}")
  install(FILES "${PROJECT_BINARY_DIR}/build_info.json" DESTINATION hmoe)
endfunction()
