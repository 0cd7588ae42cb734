// The build's identity: the project version (CMakeLists.txt) and the git commit it was
// configured from ("unknown" outside a checkout). `--version` of every binary and the
// moe_build_info metric print them.
#pragma once

namespace moe {

const char* Version();
const char* GitCommit();

}  // namespace moe
