# hmoe_cuda_mode(<value> <out>): HMOE_CUDA's value as AUTO, ON or OFF, in any case, with CMake's
# boolean spellings (1/TRUE/YES, 0/FALSE/NO) taken as ON/OFF and an empty value as AUTO. Anything
# else stops the configure: "off" used to read as AUTO and build the CUDA modules after all.
function(hmoe_cuda_mode value out)
  string(TOUPPER "${value}" v)
  if(v MATCHES "^(ON|1|TRUE|YES)$")
    set(${out} ON PARENT_SCOPE)
  elseif(v MATCHES "^(OFF|0|FALSE|NO)$")
    set(${out} OFF PARENT_SCOPE)
  elseif(v STREQUAL "AUTO" OR v STREQUAL "")
    set(${out} AUTO PARENT_SCOPE)
  else()
    message(FATAL_ERROR "hmoe: HMOE_CUDA=${value}: expected AUTO, ON or OFF")
  endif()
endfunction()
