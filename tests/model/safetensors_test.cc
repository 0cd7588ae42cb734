#include "model/safetensors.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tests/testing/model_files.h"
#include "tests/testing/temp_dir.h"

namespace moe {
namespace {

using testing::TestTensor;
using testing::WriteTestTensors;

namespace fs = std::filesystem;

// A fresh empty directory under the test temp dir.
std::string FreshDir(const std::string& name) {
  return testing::FreshTestDir("safetensors_test_" + name);
}

// Bytes that identify the tensor they belong to (never all zero).
TestTensor MakeTensor(const std::string& name, DType dtype, std::vector<int64_t> shape,
                      uint8_t tag) {
  TestTensor t{name, dtype, shape, {}};
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  t.bytes.resize(n * DTypeSize(dtype));
  for (size_t i = 0; i < t.bytes.size(); ++i)
    t.bytes[i] = static_cast<uint8_t>(tag * 31 + i * 7 + 1);
  return t;
}

// A file made of a raw 8-byte length, header text and data bytes.
void WriteRaw(const std::string& path, uint64_t header_len, const std::string& header,
              size_t data_bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((header_len >> (8 * i)) & 0xff));
  out << header;
  for (size_t i = 0; i < data_bytes; ++i) out.put(static_cast<char>(i * 13 + 5));
}

void WriteRaw(const std::string& path, const std::string& header, size_t data_bytes) {
  WriteRaw(path, header.size(), header, data_bytes);
}

std::vector<TestTensor> ThreeTensors() {
  return {MakeTensor("a.weight", DType::kBF16, {2, 3}, 1),
          MakeTensor("b.bias", DType::kF32, {4}, 2), MakeTensor("c.packed", DType::kU8, {5}, 3)};
}

TEST(SafetensorsFileTest, RoundTrip) {
  const std::string path = FreshDir("roundtrip") + "/x.safetensors";
  const auto tensors = ThreeTensors();
  ASSERT_TRUE(WriteTestTensors(path, tensors, {{"format", "pt"}}).ok());

  // Header length is a multiple of 8 so the data section is aligned.
  std::ifstream in(path, std::ios::binary);
  uint8_t len_bytes[8];
  in.read(reinterpret_cast<char*>(len_bytes), 8);
  uint64_t len = 0;
  for (int i = 7; i >= 0; --i) len = (len << 8) | len_bytes[i];
  EXPECT_EQ(len % 8, 0u);
  uint64_t data = 0;
  for (const auto& t : tensors) data += t.bytes.size();
  EXPECT_EQ(fs::file_size(path), 8 + len + data);

  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->path(), path);
  EXPECT_EQ((*file)->tensors().size(), 3u);
  EXPECT_EQ((*file)->metadata().at("format"), "pt");
  for (const TestTensor& t : tensors) {
    const TensorInfo* info = (*file)->Find(t.name);
    ASSERT_NE(info, nullptr) << t.name;
    EXPECT_EQ(info->dtype, t.dtype);
    EXPECT_EQ(info->shape, t.shape);
    EXPECT_EQ(info->size_bytes, t.bytes.size());
    auto bytes = (*file)->Data(*info);
    EXPECT_EQ(std::vector<uint8_t>(bytes.begin(), bytes.end()), t.bytes) << t.name;
    (*file)->Prefetch(*info);
  }
  EXPECT_EQ((*file)->Find("nope"), nullptr);
  EXPECT_EQ((*file)->Find("a.weight")->num_elements(), 6);
}

TEST(SafetensorsFileTest, ManySmallWritesAndOneLargeOne) {
  const std::string path = FreshDir("writes") + "/x.safetensors";
  TestTensor big = MakeTensor("big", DType::kU8, {int64_t{20} << 20}, 9);
  TestTensor small = MakeTensor("small", DType::kBF16, {1000}, 4);
  auto writer = SafetensorsWriter::Create(
      path, {{"small", DType::kBF16, {1000}}, {"big", DType::kU8, big.shape}});
  ASSERT_TRUE(writer.ok()) << writer.status();
  for (size_t i = 0; i < small.bytes.size(); i += 3)
    ASSERT_TRUE((*writer)
                    ->Write(absl::MakeConstSpan(small.bytes.data() + i,
                                                std::min<size_t>(3, small.bytes.size() - i)))
                    .ok());
  ASSERT_TRUE((*writer)->Write(big.bytes).ok());
  ASSERT_TRUE((*writer)->Finish().ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  for (const TestTensor* t : {&small, &big}) {
    auto bytes = (*file)->Data(*(*file)->Find(t->name));
    EXPECT_TRUE(std::equal(bytes.begin(), bytes.end(), t->bytes.begin(), t->bytes.end()));
  }
}

TEST(SafetensorsWriterTest, ByteCountIsChecked) {
  const std::string dir = FreshDir("writer_count");
  {
    auto writer = SafetensorsWriter::Create(dir + "/short.safetensors", {{"t", DType::kF32, {4}}});
    ASSERT_TRUE(writer.ok());
    const std::vector<uint8_t> eight(8, 1);
    ASSERT_TRUE((*writer)->Write(eight).ok());
    const absl::Status s = (*writer)->Finish();
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_CONTAINS(std::string(s.message()), "wrote 8 of the 16");
  }
  // An unfinished writer leaves no partial file behind.
  EXPECT_FALSE(fs::exists(dir + "/short.safetensors"));
  EXPECT_FALSE(fs::exists(dir + "/short.safetensors.partial"));

  auto writer = SafetensorsWriter::Create(dir + "/long.safetensors", {{"t", DType::kU8, {4}}});
  ASSERT_TRUE(writer.ok());
  const std::vector<uint8_t> five(5, 1);
  EXPECT_EQ((*writer)->Write(five).code(), absl::StatusCode::kInvalidArgument);

  EXPECT_FALSE(SafetensorsWriter::Create(dir + "/dup.safetensors",
                                         {{"t", DType::kU8, {1}}, {"t", DType::kU8, {1}}})
                   .ok());
  EXPECT_EQ(SafetensorsWriter::Create(dir + "/no/such/dir/x.safetensors", {}).status().code(),
            absl::StatusCode::kNotFound);
}

TEST(SafetensorsWriterTest, RewritingAMappedFileLeavesTheMappingIntact) {
  const std::string path = FreshDir("rewrite") + "/x.safetensors";
  const auto tensors = ThreeTensors();
  ASSERT_TRUE(WriteTestTensors(path, tensors).ok());
  auto old_file = SafetensorsFile::Open(path);
  ASSERT_TRUE(old_file.ok());
  ASSERT_TRUE(WriteTestTensors(path, {MakeTensor("other", DType::kU8, {1}, 8)}).ok());
  // The old mapping still reads the old bytes (an in-place truncation would SIGBUS here).
  auto bytes = (*old_file)->Data(*(*old_file)->Find("c.packed"));
  EXPECT_EQ(std::vector<uint8_t>(bytes.begin(), bytes.end()), tensors[2].bytes);
  auto new_file = SafetensorsFile::Open(path);
  ASSERT_TRUE(new_file.ok());
  EXPECT_EQ((*new_file)->tensors().size(), 1u);
}

// Malformed files: each error is InvalidArgument and names the file (and the tensor).
class MalformedFileTest : public ::testing::Test {
 protected:
  void SetUp() override { path_ = FreshDir("malformed") + "/bad.safetensors"; }
  absl::Status OpenStatus() { return SafetensorsFile::Open(path_).status(); }
  void ExpectInvalid(const std::vector<std::string>& substrings) {
    const absl::Status s = OpenStatus();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_CONTAINS(std::string(s.message()), path_);
    for (const std::string& sub : substrings) EXPECT_CONTAINS(std::string(s.message()), sub);
  }
  std::string path_;
};

TEST_F(MalformedFileTest, TruncatedFile) {
  ASSERT_TRUE(WriteTestTensors(path_, ThreeTensors()).ok());
  fs::resize_file(path_, fs::file_size(path_) - 3);  // cuts into the last tensor, c.packed
  ExpectInvalid({"c.packed", "out of bounds", "truncated"});
}

TEST_F(MalformedFileTest, TooShortForTheLength) {
  WriteRaw(path_, "", 0);
  fs::resize_file(path_, 5);
  ExpectInvalid({"shorter than the 8-byte header length"});
}

TEST_F(MalformedFileTest, HeaderLengthBeyondFileSize) {
  WriteRaw(path_, 1 << 20, "{}", 0);
  ExpectInvalid({"header length 1048576 exceeds the file size"});
}

TEST_F(MalformedFileTest, BadJson) {
  WriteRaw(path_, R"({"a": {"dtype": "F32", "shape": [1], )", 4);
  ExpectInvalid({"not valid JSON"});
}

TEST_F(MalformedFileTest, HeaderNotAnObject) {
  WriteRaw(path_, "[1, 2]  ", 0);
  ExpectInvalid({"not a JSON object"});
}

TEST_F(MalformedFileTest, UnknownDtype) {
  WriteRaw(path_, R"({"w": {"dtype": "Q4_K", "shape": [2], "data_offsets": [0, 2]}})", 2);
  ExpectInvalid({"'w'", "Q4_K"});
}

TEST_F(MalformedFileTest, OffsetsNotMatchingDtypeAndShape) {
  WriteRaw(path_, R"({"w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 6]}})", 6);
  ExpectInvalid({"'w'", "hold 6 bytes but BF16 [2, 3] needs 12"});
}

TEST_F(MalformedFileTest, OffsetsOutOfBounds) {
  WriteRaw(path_, R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", 8);
  ExpectInvalid({"'w'", "out of bounds"});
}

TEST_F(MalformedFileTest, OverlappingOffsets) {
  WriteRaw(path_,
           R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
               "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
           12);
  ExpectInvalid({"'b'", "overlap tensor 'a'"});
}

TEST_F(MalformedFileTest, HoleBetweenTensors) {
  WriteRaw(path_,
           R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
               "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}})",
           12);
  ExpectInvalid({"'b'", "hole"});
}

TEST_F(MalformedFileTest, NegativeShapeAndBadOffsets) {
  WriteRaw(path_, R"({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", 4);
  ExpectInvalid({"'w'", "shape"});
  WriteRaw(path_, R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4]}})", 4);
  ExpectInvalid({"'w'", "data_offsets"});
}

// A million nested arrays parse iteratively but would overflow the stack when dumped (the
// metadata of a non-string value is stored dumped): refused while parsing.
TEST_F(MalformedFileTest, DeeplyNestedHeaderIsRefused) {
  const int depth = 1000000;
  WriteRaw(path_,
           R"({"__metadata__": {"x": )" + std::string(depth, '[') + std::string(depth, ']') + "}}",
           0);
  ExpectInvalid({"header is not valid JSON: nested deeper than 64 levels"});
  WriteRaw(path_, R"({"__metadata__": {"x": [[1, 2], {"a": [3]}]}})", 0);  // shallow is fine
  auto file = SafetensorsFile::Open(path_);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->metadata().at("x"), R"([[1,2],{"a":[3]}])");
}

// The parser works on bytes, as SafetensorsFile::Open hands them over from the mapping.
TEST(ParseSafetensorsHeaderTest, ParsesBytes) {
  const std::string header = R"({"w": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]}})";
  std::vector<uint8_t> file(8 + header.size() + 3, 7);
  for (int i = 0; i < 8; ++i) file[i] = static_cast<uint8_t>(header.size() >> (8 * i));
  std::copy(header.begin(), header.end(), file.begin() + 8);
  auto parsed = ParseSafetensorsHeader(file, "mem.safetensors");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->data_start, 8 + header.size());
  ASSERT_EQ(parsed->tensors.count("w"), 1u);
  EXPECT_EQ(parsed->tensors.at("w").size_bytes, 3u);
  file.pop_back();
  EXPECT_EQ(ParseSafetensorsHeader(file, "mem.safetensors").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      ParseSafetensorsHeader(absl::Span<const uint8_t>(), "mem.safetensors").status().message(),
      "mem.safetensors: invalid safetensors file: file is 0 bytes, shorter than the 8-byte "
      "header length");
}

TEST(SafetensorsFileTest, MissingFileIsNotFound) {
  auto file = SafetensorsFile::Open(::testing::TempDir() + "/does/not/exist.safetensors");
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound);
  EXPECT_CONTAINS(std::string(file.status().message()), "exist.safetensors");
}

// ---- checkpoint directories -----------------------------------------------------------------

void WriteIndex(const std::string& dir,
                const std::vector<std::pair<std::string, std::string>>& map) {
  std::ofstream out(dir + "/model.safetensors.index.json");
  out << "{\"metadata\": {\"total_size\": 0}, \"weight_map\": {";
  for (size_t i = 0; i < map.size(); ++i)
    out << (i ? ", " : "") << "\"" << map[i].first << "\": \"" << map[i].second << "\"";
  out << "}}";
}

TEST(SafetensorsCheckpointTest, SingleFile) {
  const std::string dir = FreshDir("single");
  const auto tensors = ThreeTensors();
  ASSERT_TRUE(WriteTestTensors(dir + "/model.safetensors", tensors).ok());
  auto ckpt = SafetensorsCheckpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->TensorNames(), (std::vector<std::string>{"a.weight", "b.bias", "c.packed"}));
  EXPECT_TRUE((*ckpt)->Contains("b.bias"));
  auto found = (*ckpt)->FindChecked("b.bias", DType::kF32, {4});
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->file->path(), dir + "/model.safetensors");
  auto bytes = found->file->Data(*found->info);
  EXPECT_EQ(std::vector<uint8_t>(bytes.begin(), bytes.end()), tensors[1].bytes);
}

TEST(SafetensorsCheckpointTest, ShardedWithIndex) {
  const std::string dir = FreshDir("sharded");
  const auto tensors = ThreeTensors();
  ASSERT_TRUE(
      WriteTestTensors(dir + "/model-00001-of-00002.safetensors", {tensors[0], tensors[1]}).ok());
  ASSERT_TRUE(WriteTestTensors(dir + "/model-00002-of-00002.safetensors", {tensors[2]}).ok());
  WriteIndex(dir, {{"a.weight", "model-00001-of-00002.safetensors"},
                   {"b.bias", "model-00001-of-00002.safetensors"},
                   {"c.packed", "model-00002-of-00002.safetensors"}});
  auto ckpt = SafetensorsCheckpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->TensorNames().size(), 3u);
  for (const TestTensor& t : tensors) {
    auto found = (*ckpt)->FindChecked(t.name, t.dtype, t.shape);
    ASSERT_TRUE(found.ok()) << found.status();
    auto bytes = found->file->Data(*found->info);
    EXPECT_EQ(std::vector<uint8_t>(bytes.begin(), bytes.end()), t.bytes);
  }
  EXPECT_EQ((*ckpt)->Find("c.packed")->file->path(), dir + "/model-00002-of-00002.safetensors");

  // Concurrent first use: every thread sees the same lazily opened shard.
  auto fresh = SafetensorsCheckpoint::Open(dir);
  ASSERT_TRUE(fresh.ok());
  std::vector<const SafetensorsFile*> seen(8, nullptr);
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i)
    threads.emplace_back([&, i] {
      auto f = (*fresh)->Find(i % 2 ? "a.weight" : "b.bias");
      if (f.ok()) seen[i] = f->file;
    });
  for (auto& t : threads) t.join();
  for (const SafetensorsFile* f : seen) EXPECT_EQ(f, seen[0]);
  EXPECT_NE(seen[0], nullptr);
}

TEST(SafetensorsCheckpointTest, FindCheckedErrorsNameTensorAndFile) {
  const std::string dir = FreshDir("checked");
  ASSERT_TRUE(
      WriteTestTensors(dir + "/model-00001-of-00002.safetensors",
                       {MakeTensor("model.layers.1.mlp.gate.weight", DType::kF32, {4, 8}, 5)})
          .ok());
  ASSERT_TRUE(WriteTestTensors(dir + "/model-00002-of-00002.safetensors", ThreeTensors()).ok());
  WriteIndex(dir, {{"model.layers.1.mlp.gate.weight", "model-00001-of-00002.safetensors"},
                   {"a.weight", "model-00002-of-00002.safetensors"}});
  auto ckpt = SafetensorsCheckpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();

  auto wrong_dtype = (*ckpt)->FindChecked("model.layers.1.mlp.gate.weight", DType::kBF16, {4, 8});
  EXPECT_EQ(wrong_dtype.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(wrong_dtype.status().message(),
            "tensor 'model.layers.1.mlp.gate.weight' in " + dir +
                "/model-00001-of-00002.safetensors: dtype F32, expected BF16");

  auto wrong_shape = (*ckpt)->FindChecked("model.layers.1.mlp.gate.weight", DType::kF32, {8, 4});
  EXPECT_EQ(wrong_shape.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_CONTAINS(wrong_shape.status().message(), "shape [4, 8], expected [8, 4]");

  auto missing = (*ckpt)->FindChecked("model.layers.9.mlp.gate.weight", DType::kF32, {4, 8});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_CONTAINS(missing.status().message(), "model.layers.9.mlp.gate.weight");
  EXPECT_CONTAINS(std::string(missing.status().message()), dir);
}

TEST(SafetensorsCheckpointTest, MissingShardIsNotFound) {
  const std::string dir = FreshDir("missing_shard");
  ASSERT_TRUE(WriteTestTensors(dir + "/model-00001-of-00002.safetensors", ThreeTensors()).ok());
  WriteIndex(dir, {{"a.weight", "model-00001-of-00002.safetensors"},
                   {"z.weight", "model-00002-of-00002.safetensors"}});
  auto ckpt = SafetensorsCheckpoint::Open(dir);
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kNotFound);
  EXPECT_CONTAINS(std::string(ckpt.status().message()), "model-00002-of-00002.safetensors");
}

TEST(SafetensorsCheckpointTest, BadIndexOrNoFiles) {
  const std::string empty = FreshDir("empty");
  EXPECT_EQ(SafetensorsCheckpoint::Open(empty).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(SafetensorsCheckpoint::Open(empty + "/nope").status().code(),
            absl::StatusCode::kNotFound);

  const std::string two = FreshDir("two_files");
  ASSERT_TRUE(WriteTestTensors(two + "/a.safetensors", ThreeTensors()).ok());
  ASSERT_TRUE(WriteTestTensors(two + "/b.safetensors", ThreeTensors()).ok());
  auto ckpt = SafetensorsCheckpoint::Open(two);
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kNotFound);
  EXPECT_CONTAINS(std::string(ckpt.status().message()), "a.safetensors, b.safetensors");

  const std::string bad = FreshDir("bad_index");
  { std::ofstream(bad + "/model.safetensors.index.json") << "{\"weight_map\": [}"; }
  EXPECT_EQ(SafetensorsCheckpoint::Open(bad).status().code(), absl::StatusCode::kInvalidArgument);
  { std::ofstream(bad + "/model.safetensors.index.json") << "{\"metadata\": {}}"; }
  EXPECT_EQ(SafetensorsCheckpoint::Open(bad).status().code(), absl::StatusCode::kInvalidArgument);

  // A shard whose header is broken fails at first use, naming the shard.
  const std::string broken = FreshDir("broken_shard");
  WriteRaw(broken + "/model-00001-of-00001.safetensors", "{oops", 0);
  WriteIndex(broken, {{"a", "model-00001-of-00001.safetensors"}});
  auto lazy = SafetensorsCheckpoint::Open(broken);
  ASSERT_TRUE(lazy.ok()) << lazy.status();
  auto found = (*lazy)->Find("a");
  EXPECT_EQ(found.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_CONTAINS(std::string(found.status().message()), "model-00001-of-00001.safetensors");
}

}  // namespace
}  // namespace moe
