// Handing freed heap memory back to the operating system.
//
// glibc keeps freed chunks in its arenas for reuse, so a burst of large buffers (responses held
// for slow readers, requests refused mid-read) leaves the process's resident size at its peak
// for good. Services call ReturnFreedMemory() after such a burst has ended.
#pragma once

#include <cstdint>

namespace moe {

// Below this much, a burst is left to glibc's own trimming.
inline constexpr int64_t kReturnFreedMemoryAfterBytes = int64_t{8} << 20;

// Returns the free pages of every malloc arena to the system (malloc_trim; a no-op elsewhere).
void ReturnFreedMemory();

}  // namespace moe
