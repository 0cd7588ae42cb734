#include "core/npy.h"

#include <unistd.h>

#include <cstdio>
#include <filesystem>

#include "gtest/gtest.h"

namespace moe {
namespace {

TEST(NpyTest, Float32RoundTrip) {
  const std::string path =
      ::testing::TempDir() + "/npy_roundtrip_" + std::to_string(getpid()) + ".npy";
  std::vector<float> data = {1.5f, -2.25f, 3.0f, 1e-3f, 7.0f, -0.0f};
  ASSERT_TRUE(WriteNpyFloat32(path, {2, 3}, data.data()).ok());
  auto read = ReadNpy(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(read->data, data);
  EXPECT_EQ(read->descr, "<f4");
}

TEST(NpyTest, Int32AndOneDimensional) {
  const std::string path = ::testing::TempDir() + "/npy_ints_" + std::to_string(getpid()) + ".npy";
  std::vector<int32_t> data = {3, -1, 7};
  ASSERT_TRUE(WriteNpyInt32(path, {3}, data.data()).ok());
  auto read = ReadNpy(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->shape, (std::vector<int64_t>{3}));
  EXPECT_EQ(read->ints, data);
}

TEST(NpyTest, Float16Converted) {
  const uint16_t halves[3] = {0x3c00, 0xc000, 0x3555};  // 1, -2, 0.33325
  const std::string bytes = EncodeNpy("<f2", {3}, halves, sizeof(halves));
  auto read = ParseNpy(bytes, "mem");
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->data[0], 1.0f);
  EXPECT_EQ(read->data[1], -2.0f);
  EXPECT_NEAR(read->data[2], 0.33325f, 1e-5);
}

TEST(NpyTest, TwoByteBitPatternsReadAsTheirUint16Values) {
  // uint16, and 'V2' (how numpy saves ml_dtypes.bfloat16): the patterns, high bit included.
  const uint16_t bits[3] = {0x3fc0, 0xc010, 0xffff};
  for (const char* descr : {"<u2", "|V2", "<V2"}) {
    auto read = ParseNpy(EncodeNpy(descr, {3}, bits, sizeof(bits)), "mem");
    ASSERT_TRUE(read.ok()) << descr << ": " << read.status();
    EXPECT_EQ(read->ints, (std::vector<int32_t>{0x3fc0, 0xc010, 0xffff})) << descr;
    EXPECT_TRUE(read->data.empty());
  }
  EXPECT_FALSE(ParseNpy(EncodeNpy("<u2", {4}, bits, sizeof(bits)), "mem").ok());  // short payload
}

TEST(NpyTest, MalformedInputsAreErrors) {
  EXPECT_FALSE(ParseNpy("hello", "x").ok());
  const float one = 1.0f;
  std::string bytes = EncodeNpy("<f4", {2}, &one, 4);  // payload too short for shape (2,)
  auto r = ParseNpy(bytes, "short.npy");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("short.npy"), std::string::npos);
  EXPECT_FALSE(ParseNpy(EncodeNpy("<c8", {1}, "12345678", 8), "c").ok());
  EXPECT_EQ(ReadNpy("/nonexistent/file.npy").status().code(), absl::StatusCode::kNotFound);
}

// Found by tests/fuzz (npy target, UBSan): the element count of a huge shape overflowed int64,
// and a count whose byte size wrapped to 0 would have passed the payload check and been
// allocated.
// A version 1.0 file whose header says `shape_text`, with 8 bytes of float64 payload.
std::string NpyWithShape(const std::string& shape_text) {
  const std::string header =
      "{'descr': '<f8', 'fortran_order': False, 'shape': " + shape_text + ", }\n";
  std::string out("\x93NUMPY\x01\x00", 8);
  out.push_back(static_cast<char>(header.size() & 0xff));
  out.push_back(static_cast<char>(header.size() >> 8));
  return out + header + "12345678";
}

TEST(NpyTest, ShapeTooLargeForAnyFileIsRefused) {
  ASSERT_TRUE(ParseNpy(NpyWithShape("(1,)"), "one.npy").ok());
  for (const char* shape :
       {"(9223372036854775807, 3)", "(4294967296, 4294967296)", "(2305843009213693952,)"}) {
    const absl::StatusOr<NpyArray> r = ParseNpy(NpyWithShape(shape), "huge.npy");
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << shape;
    EXPECT_NE(r.status().message().find("is too large"), std::string::npos) << r.status();
  }
  // Zero-sized arrays stay valid (a zero first dimension keeps every product at 0).
  auto empty =
      ParseNpy(EncodeNpy("<f4", {0, int64_t{1} << 40, int64_t{1} << 40}, nullptr, 0), "empty.npy");
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->num_elements(), 0);
}

}  // namespace
}  // namespace moe
