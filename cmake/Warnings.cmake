# Project-wide warnings; -Werror unless MOE_WERROR=OFF. Applied to our targets only
# (via moe_target_warnings), never to generated protobuf code.
# -ffp-contract=off: the numerics contract fixes every fp32 rounding (no silent FMA contraction).
add_compile_options($<$<COMPILE_LANGUAGE:CXX,C>:-ffp-contract=off>)
set(MOE_WARNING_FLAGS -Wall -Wextra -Wpedantic -Wshadow=local -Wnon-virtual-dtor -Wno-unused-parameter -Wno-missing-field-initializers)
if(CMAKE_CXX_COMPILER_ID MATCHES "Clang")  # the MOE_FUZZ build: clang spells local shadowing so
  list(TRANSFORM MOE_WARNING_FLAGS REPLACE "^-Wshadow=local$" "-Wshadow-uncaptured-local")
endif()
if(MOE_WERROR)
  list(APPEND MOE_WARNING_FLAGS -Werror)
endif()

function(moe_target_warnings target)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${MOE_WARNING_FLAGS}>)
endfunction()
