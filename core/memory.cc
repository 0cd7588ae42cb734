#include "core/memory.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace moe {

void ReturnFreedMemory() {
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
}

}  // namespace moe
