#include "core/npy.h"

#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/numerics.h"

namespace moe {
namespace {

absl::Status Malformed(const std::string& what, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(what, ": not a valid .npy file: ", why));
}

// Extracts the value text of `'key': value` from the header dict.
bool HeaderField(absl::string_view header, absl::string_view key, absl::string_view* value) {
  const std::string quoted = absl::StrCat("'", key, "'");
  size_t pos = header.find(quoted);
  if (pos == absl::string_view::npos) return false;
  pos = header.find(':', pos + quoted.size());
  if (pos == absl::string_view::npos) return false;
  absl::string_view rest = absl::StripLeadingAsciiWhitespace(header.substr(pos + 1));
  size_t end;
  if (!rest.empty() && rest[0] == '(') {
    end = rest.find(')');
    if (end == absl::string_view::npos) return false;
    ++end;
  } else if (!rest.empty() && rest[0] == '\'') {
    end = rest.find('\'', 1);
    if (end == absl::string_view::npos) return false;
    ++end;
  } else {
    end = rest.find_first_of(",}");
    if (end == absl::string_view::npos) end = rest.size();
  }
  *value = absl::StripAsciiWhitespace(rest.substr(0, end));
  return true;
}

}  // namespace

int64_t NpyArray::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::StatusOr<NpyArray> ParseNpy(const std::string& bytes, const std::string& what) {
  if (bytes.size() < 10 || std::memcmp(bytes.data(), "\x93NUMPY", 6) != 0)
    return Malformed(what, "missing magic");
  const uint8_t major = static_cast<uint8_t>(bytes[6]);
  size_t header_len, header_start;
  if (major == 1) {
    header_len =
        static_cast<uint8_t>(bytes[8]) | (static_cast<size_t>(static_cast<uint8_t>(bytes[9])) << 8);
    header_start = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) return Malformed(what, "truncated header");
    header_len = 0;
    for (int i = 0; i < 4; ++i)
      header_len |= static_cast<size_t>(static_cast<uint8_t>(bytes[8 + i])) << (8 * i);
    header_start = 12;
  } else {
    return Malformed(what, absl::StrCat("unsupported version ", major));
  }
  if (header_start + header_len > bytes.size()) return Malformed(what, "truncated header");
  const absl::string_view header(bytes.data() + header_start, header_len);

  absl::string_view descr, fortran, shape_text;
  if (!HeaderField(header, "descr", &descr) || !HeaderField(header, "fortran_order", &fortran) ||
      !HeaderField(header, "shape", &shape_text))
    return Malformed(what, "header lacks descr/fortran_order/shape");
  if (fortran != "False") return Malformed(what, "Fortran-order arrays are not supported");
  descr = absl::StripPrefix(absl::StripSuffix(descr, "'"), "'");

  NpyArray out;
  out.descr = std::string(descr);
  shape_text = absl::StripSuffix(absl::StripPrefix(shape_text, "("), ")");
  // NOTES: every prefix product of the shape stays below 2^63 / 8, so neither the element
  // count (num_elements multiplies in this order) nor its byte count can overflow; a shape
  // that big needs more bytes than any file holds, whatever its dtype.
  int64_t n = 1;
  for (absl::string_view part : absl::StrSplit(shape_text, ',', absl::SkipWhitespace())) {
    int64_t d;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(part), &d) || d < 0)
      return Malformed(what, absl::StrCat("bad shape entry '", part, "'"));
    if (d > 0 && n > std::numeric_limits<int64_t>::max() / 8 / d)
      return Malformed(what, absl::StrCat("shape (", shape_text, ") is too large"));
    n *= d;
    out.shape.push_back(d);
  }
  const char* payload = bytes.data() + header_start + header_len;
  const size_t payload_bytes = bytes.size() - header_start - header_len;

  size_t elem;
  if (descr == "|b1" || descr == "|u1" || descr == "|i1")
    elem = 1;
  else if (descr == "<f4" || descr == "<i4")
    elem = 4;
  else if (descr == "<f2" || descr == "<u2" || descr == "|V2" || descr == "<V2")
    elem = 2;
  else if (descr == "<f8" || descr == "<i8")
    elem = 8;
  else
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": unsupported .npy dtype '", descr,
        "' (float16, float32, float64, int32, int64, bool, uint8, uint16, 2-byte void)"));
  if (payload_bytes != static_cast<size_t>(n) * elem)
    return Malformed(what,
                     absl::StrCat("payload is ", payload_bytes, " bytes, shape needs ", n * elem));

  if (descr == "<f4") {
    out.data.resize(n);
    if (n > 0) std::memcpy(out.data.data(), payload, n * 4);
  } else if (descr == "<f2") {
    out.data.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, payload + 2 * i, 2);
      out.data[i] = HalfBitsToFloat(h);
    }
  } else if (descr == "<f8") {
    out.data.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      double d;
      std::memcpy(&d, payload + 8 * i, 8);
      out.data[i] = static_cast<float>(d);
    }
  } else if (elem == 1) {
    out.ints.resize(n);
    for (int64_t i = 0; i < n; ++i)
      out.ints[i] =
          descr == "|i1" ? static_cast<int8_t>(payload[i]) : static_cast<uint8_t>(payload[i]);
  } else if (elem == 2) {
    // uint16, or a 2-byte type numpy cannot name (ml_dtypes' bfloat16 is saved as 'V2'): the
    // 16-bit patterns; what they mean is the reader's to say.
    out.ints.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      uint16_t v;
      std::memcpy(&v, payload + 2 * i, 2);
      out.ints[i] = v;
    }
  } else if (descr == "<i4") {
    out.ints.resize(n);
    if (n > 0) std::memcpy(out.ints.data(), payload, n * 4);
  } else {
    out.ints.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      int64_t v;
      std::memcpy(&v, payload + 8 * i, 8);
      out.ints[i] = static_cast<int32_t>(v);
    }
  }
  return out;
}

absl::StatusOr<NpyArray> ReadNpy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ParseNpy(ss.str(), path);
}

std::string EncodeNpy(const std::string& descr, const std::vector<int64_t>& shape, const void* data,
                      size_t bytes) {
  std::string shape_text = "(";
  for (size_t i = 0; i < shape.size(); ++i)
    absl::StrAppend(&shape_text, shape[i],
                    shape.size() == 1 ? "," : (i + 1 < shape.size() ? ", " : ""));
  shape_text += ")";
  std::string header =
      absl::StrCat("{'descr': '", descr, "', 'fortran_order': False, 'shape': ", shape_text, ", }");
  // Pad so that magic(6) + version(2) + len(2) + header + '\n' is a multiple of 64.
  const size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header.push_back('\n');
  std::string out("\x93NUMPY\x01\x00", 8);
  out.push_back(static_cast<char>(header.size() & 0xff));
  out.push_back(static_cast<char>(header.size() >> 8));
  out += header;
  out.append(static_cast<const char*>(data), bytes);
  return out;
}

namespace {
absl::Status WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::PermissionDeniedError(absl::StrCat("cannot write ", path));
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) return absl::DataLossError(absl::StrCat("short write to ", path));
  return absl::OkStatus();
}

int64_t Product(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}
}  // namespace

absl::Status WriteNpyFloat32(const std::string& path, const std::vector<int64_t>& shape,
                             const float* data) {
  return WriteBytes(path, EncodeNpy("<f4", shape, data, Product(shape) * 4));
}

absl::Status WriteNpyInt32(const std::string& path, const std::vector<int64_t>& shape,
                           const int32_t* data) {
  return WriteBytes(path, EncodeNpy("<i4", shape, data, Product(shape) * 4));
}

}  // namespace moe
