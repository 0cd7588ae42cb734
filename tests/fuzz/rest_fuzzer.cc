// The REST API's bodies (server/gateway/kserve_json.h): bytes -> ParseRestInferRequest (JSON, or
// with the first byte's low bits choosing a JSON header length, the binary tensor extension) ->
// ToForwardRequest, as the HTTP server does; and a response formatted back from what was sent.
#include <cstdint>
#include <optional>
#include <string>

#include "absl/strings/string_view.h"
#include "server/gateway/kserve_codec.h"
#include "server/gateway/kserve_json.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/quiet_protobuf.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const QuietProtobuf quiet;
  if (size == 0) return 0;
  // First byte: 0 = plain JSON; otherwise the JSON header is the first (byte * 7) % size bytes.
  const absl::string_view body(reinterpret_cast<const char*>(data) + 1, size - 1);
  std::optional<size_t> json_length;
  if (data[0] != 0) json_length = (size_t{data[0]} * 7) % (body.size() + 2);
  const absl::StatusOr<inference::ModelInferRequest> request =
      moe::ParseRestInferRequest("moe-layer-1", "", body, json_length);
  if (!request.ok()) {
    FUZZ_CHECK_CODE(request.status(), absl::StatusCode::kInvalidArgument);
    return 0;
  }
  FUZZ_CHECK(request->raw_input_contents_size() == request->inputs_size());
  size_t raw = 0;
  for (const std::string& bytes : request->raw_input_contents()) raw += bytes.size();
  if (json_length.has_value()) FUZZ_CHECK(raw >= body.size() - *json_length);
  const absl::StatusOr<moe::KServeCall> call = moe::ToForwardRequest(*request);
  if (!call.ok()) {
    FUZZ_CHECK_CODE(call.status(), absl::StatusCode::kInvalidArgument, absl::StatusCode::kNotFound);
    return 0;
  }
  // Echo the input as the output: it formats as JSON numbers or binary, whatever was asked.
  inference::ModelInferResponse response;
  response.set_model_name(request->model_name());
  response.set_id(request->id());
  auto* out = response.add_outputs();
  out->set_name("output");
  out->set_datatype(request->inputs(0).datatype());
  response.add_raw_output_contents(request->raw_input_contents(0));
  const moe::RestBody rest = moe::FormatRestInferResponse(*request, response);
  FUZZ_CHECK(!rest.body.empty() && rest.body.front() == '{');
  if (rest.json_length.has_value()) FUZZ_CHECK(*rest.json_length <= rest.body.size());
  return 0;
}
