// Memory-mapped safetensors checkpoints, single file or sharded with an index.
//
// Opening reads only headers; tensor bytes are paged in from the mapping when a caller
// touches them, so asking for one layer and one expert range reads only those bytes.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/dtype.h"

namespace moe {

struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t data_offset = 0;  // from the start of the file's data section
  uint64_t size_bytes = 0;
  int64_t num_elements() const;
};

// A safetensors file's header: its tensor table and metadata, validated against the file.
struct SafetensorsHeader {
  std::map<std::string, TensorInfo> tensors;
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;  // where the data section begins: 8 + the header's length
};

// Parses and validates the header of the file whose bytes are `file`: offsets in bounds and
// contiguous, sizes matching dtype x shape, file not truncated. InvalidArgument naming `path`
// (and the tensor) otherwise. The untrusted-bytes half of SafetensorsFile::Open.
absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(absl::Span<const uint8_t> file,
                                                         const std::string& path);

// One .safetensors file, mmap'ed read-only.
class SafetensorsFile {
 public:
  // Parses and validates the header: offsets in bounds and contiguous, sizes matching
  // dtype x shape, file not truncated. Errors name the file (and the tensor).
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const TensorInfo* Find(const std::string& name) const;  // nullptr when absent
  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The tensor's bytes inside the mapping.
  absl::Span<const uint8_t> Data(const TensorInfo& info) const;
  // Asks the kernel to read a tensor's pages ahead (MADV_WILLNEED).
  void Prefetch(const TensorInfo& info) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  const uint8_t* map_ = nullptr;
  size_t map_size_ = 0;
  const uint8_t* data_section_ = nullptr;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// `model.safetensors.index.json`: tensor name -> shard file name. INVALID_ARGUMENT (prefixed
// with `what`) for malformed JSON, a missing weight_map, or a shard that is not a plain file
// name in the checkpoint directory. Pure: the fuzz target calls it on arbitrary bytes.
absl::StatusOr<std::map<std::string, std::string>> ParseSafetensorsIndex(absl::string_view text,
                                                                         const std::string& what);

// A checkpoint directory: `model.safetensors.index.json` + shards, or one `*.safetensors`.
// Shards open lazily on first use, so a rank maps only the files holding its tensors.
// Thread-safe: several threads may Find/load tensors concurrently.
class SafetensorsCheckpoint {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsCheckpoint>> Open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  bool Contains(const std::string& name) const;
  // All tensor names (from the index, or from the single file's header).
  std::vector<std::string> TensorNames() const;
  // Locates a tensor: NotFound naming the tensor and the directory when absent.
  struct Located {
    const SafetensorsFile* file;
    const TensorInfo* info;
  };
  absl::StatusOr<Located> Find(const std::string& name) const;
  // Finds a tensor and checks its dtype and shape; the error names tensor and file.
  absl::StatusOr<Located> FindChecked(const std::string& name, DType dtype,
                                      const std::vector<int64_t>& shape) const;

 private:
  SafetensorsCheckpoint() = default;
  absl::StatusOr<const SafetensorsFile*> Shard(const std::string& file_name) const;
  std::string dir_;
  std::map<std::string, std::string> weight_map_;  // tensor -> shard file name
  // std::mutex (not absl::Mutex): visible to ThreadSanitizer with Debian's uninstrumented Abseil.
  mutable std::mutex shards_mu_;
  // Opened shards by file name; entries are never removed, so pointers to them stay valid.
  mutable std::map<std::string, std::unique_ptr<SafetensorsFile>> shards_
      ABSL_GUARDED_BY(shards_mu_);
};

// Writes safetensors files. Tensors are appended in the order added and streamed to disk
// (the writer never holds a whole shard in memory). Bytes go to `<path>.partial`, renamed to
// `path` by a successful Finish: a reader never sees a half-written file, and a process that
// has the old file mapped keeps its pages (rewriting it in place would SIGBUS it). A writer
// destroyed before Finish removes its partial file.
class SafetensorsWriter {
 public:
  struct PendingTensor {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
  };
  // Declares the tensors of one file up front (the header precedes the data), then
  // `Write` streams each tensor's bytes in the declared order.
  static absl::StatusOr<std::unique_ptr<SafetensorsWriter>> Create(
      const std::string& path, const std::vector<PendingTensor>& tensors,
      const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  // Appends bytes of the current tensor; may be called several times per tensor.
  absl::Status Write(absl::Span<const uint8_t> bytes);
  // Checks every declared byte was written, fsyncs and closes the file.
  absl::Status Finish();

  uint64_t written_bytes() const { return written_bytes_; }
  uint64_t expected_bytes() const { return expected_bytes_; }

 private:
  SafetensorsWriter() = default;
  absl::Status WriteFully(const uint8_t* data, size_t size);
  absl::Status Flush();
  std::string path_;
  std::string partial_path_;
  int fd_ = -1;
  uint64_t expected_bytes_ = 0;
  uint64_t written_bytes_ = 0;
  // Small writes are gathered here so the file sees large `write` calls.
  std::vector<uint8_t> buffer_;
};

}  // namespace moe
