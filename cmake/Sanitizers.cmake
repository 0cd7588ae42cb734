if(MOE_SANITIZE AND MOE_TSAN)
  message(FATAL_ERROR "MOE_SANITIZE (ASan/UBSan) and MOE_TSAN are exclusive")
endif()
if(MOE_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "MOE_FUZZ needs clang (libFuzzer): -DCMAKE_CXX_COMPILER=clang++")
  endif()
  if(MOE_SANITIZE OR MOE_TSAN)
    message(FATAL_ERROR "MOE_FUZZ brings its own ASan/UBSan; leave MOE_SANITIZE and MOE_TSAN off")
  endif()
  # Every object gets coverage and the sanitizers; the fuzz_* executables add libFuzzer's main
  # (tests/fuzz). Only those targets build in such a tree: see docs/FUZZING.md.
  add_compile_options($<$<COMPILE_LANGUAGE:CXX,C>:-fsanitize=fuzzer-no-link,address,undefined>
                      $<$<COMPILE_LANGUAGE:CXX,C>:-fno-sanitize-recover=undefined>
                      $<$<COMPILE_LANGUAGE:CXX,C>:-fno-omit-frame-pointer>)
  add_link_options(-fsanitize=address,undefined)
endif()
if(MOE_SANITIZE)
  add_compile_options($<$<COMPILE_LANGUAGE:CXX,C>:-fsanitize=address,undefined>
                      $<$<COMPILE_LANGUAGE:CXX,C>:-fno-sanitize-recover=undefined>
                      $<$<COMPILE_LANGUAGE:CXX,C>:-fno-omit-frame-pointer>)
  add_link_options(-fsanitize=address,undefined)
endif()
if(MOE_TSAN)
  add_compile_options($<$<COMPILE_LANGUAGE:CXX,C>:-fsanitize=thread> $<$<COMPILE_LANGUAGE:CXX,C>:-fno-omit-frame-pointer>)
  add_link_options(-fsanitize=thread)
endif()
