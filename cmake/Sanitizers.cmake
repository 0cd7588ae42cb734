if(MOE_SANITIZE AND MOE_TSAN)
  message(FATAL_ERROR "MOE_SANITIZE (ASan/UBSan) and MOE_TSAN are exclusive")
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
