#include "model/bounded_json.h"

#include "absl/strings/str_cat.h"

namespace moe {
namespace {
struct TooDeep {};  // thrown out of the parser's callback: it has no other way to stop
}  // namespace

absl::StatusOr<nlohmann::json> ParseBoundedJson(absl::string_view text, int max_depth) {
  using Json = nlohmann::json;
  // `depth` counts the containers open around the event, so a container that opens at
  // depth max_depth would be the (max_depth + 1)-th level.
  const Json::parser_callback_t bound = [max_depth](int depth, Json::parse_event_t event, Json&) {
    if ((event == Json::parse_event_t::object_start || event == Json::parse_event_t::array_start) &&
        depth >= max_depth)
      throw TooDeep();
    return true;
  };
  try {
    return Json::parse(text.begin(), text.end(), bound);
  } catch (const TooDeep&) {
    return absl::InvalidArgumentError(absl::StrCat("nested deeper than ", max_depth, " levels"));
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(e.what());
  }
}

}  // namespace moe
