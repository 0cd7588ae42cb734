// Protobuf logs every message it rejects for invalid UTF-8 in a string field; a fuzzer makes
// millions. Constructing one of these (once) turns its logging off.
#pragma once

#include <string>

#include "google/protobuf/stubs/logging.h"

struct QuietProtobuf {
  QuietProtobuf() {
    google::protobuf::SetLogHandler(
        [](google::protobuf::LogLevel, const char*, int, const std::string&) {});
  }
};
