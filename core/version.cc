#include "core/version.h"

#ifndef MOE_VERSION
#define MOE_VERSION "unknown"
#endif
#ifndef MOE_GIT_COMMIT
#define MOE_GIT_COMMIT "unknown"
#endif

namespace moe {

const char* Version() { return MOE_VERSION; }
const char* GitCommit() { return MOE_GIT_COMMIT; }

}  // namespace moe
