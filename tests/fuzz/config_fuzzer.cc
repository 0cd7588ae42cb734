// model/config.cc: config.json into a MoeConfig, validation included.
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "model/config.h"
#include "tests/fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  const absl::StatusOr<moe::MoeConfig> config = moe::ParseMoeConfig(text);
  if (!config.ok()) {
    FUZZ_CHECK_CODE(config.status(), absl::StatusCode::kInvalidArgument);
    return 0;
  }
  // What the parser accepts is servable, and writes back to the same config.
  FUZZ_CHECK(config->Validate().ok());
  const absl::StatusOr<moe::MoeConfig> again = moe::ParseMoeConfig(moe::MoeConfigToJson(*config));
  FUZZ_CHECK(again.ok());
  FUZZ_CHECK(*again == *config);
  // As Checkpoint::Open uses it: asked about the layers of the tensor names it finds.
  for (int layer : {-1, 0, 1, 2, 61, 92, std::numeric_limits<int>::max()})
    (void)config->IsMoeLayer(layer);
  if (config->num_hidden_layers <= 4096) {  // a size this program writes configs for
    const std::vector<int> layers = config->MoeLayerIndices();
    FUZZ_CHECK(!layers.empty());
    for (int layer : layers) FUZZ_CHECK(config->IsMoeLayer(layer));
  }
  return 0;
}
