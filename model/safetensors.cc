#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "core/status.h"
#include "model/bounded_json.h"

namespace moe {
namespace {

using Json = nlohmann::json;

constexpr char kIndexFile[] = "model.safetensors.index.json";
// Refuse absurd headers before allocating for them (real ones are a few MB at most).
constexpr uint64_t kMaxHeaderBytes = 1ull << 30;

absl::Status ErrnoStatus(absl::string_view what, const std::string& path, int err) {
  const std::string message = absl::StrCat(what, " ", path, ": ", std::strerror(err));
  if (err == ENOENT) return absl::NotFoundError(message);
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(message);
  if (err == ENOSPC || err == EDQUOT) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

std::string JoinPath(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  if (dir.back() == '/') return dir + name;
  return dir + "/" + name;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::Status Malformed(const std::string& path, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": invalid safetensors file: ", why));
}

absl::Status MalformedTensor(const std::string& path, const std::string& name,
                             absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat(path, ": invalid safetensors file: tensor '", name, "': ", why));
}

// Parses one header entry into `info` (offsets are checked against each other later).
absl::Status ParseTensorEntry(const std::string& path, const std::string& name, const Json& entry,
                              TensorInfo* info) {
  if (!entry.is_object()) return MalformedTensor(path, name, "entry is not a JSON object");
  const auto dtype_it = entry.find("dtype");
  const auto shape_it = entry.find("shape");
  const auto offsets_it = entry.find("data_offsets");
  if (dtype_it == entry.end() || !dtype_it->is_string())
    return MalformedTensor(path, name, "missing string field 'dtype'");
  if (shape_it == entry.end() || !shape_it->is_array())
    return MalformedTensor(path, name, "missing array field 'shape'");
  if (offsets_it == entry.end() || !offsets_it->is_array() || offsets_it->size() != 2)
    return MalformedTensor(path, name, "'data_offsets' must be an array [begin, end]");

  info->name = name;
  const std::string dtype_name = dtype_it->get<std::string>();
  absl::StatusOr<DType> dtype = ParseDTypeName(dtype_name);
  if (!dtype.ok()) return MalformedTensor(path, name, dtype.status().message());
  info->dtype = *dtype;

  uint64_t elements = 1;
  for (const Json& dim : *shape_it) {
    if (!dim.is_number_unsigned())
      return MalformedTensor(
          path, name, absl::StrCat("shape entry ", dim.dump(), " is not a non-negative integer"));
    const uint64_t d = dim.get<uint64_t>();
    if (d > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
        (d != 0 && elements > std::numeric_limits<uint64_t>::max() / 8 / d))
      return MalformedTensor(path, name, absl::StrCat("shape ", shape_it->dump(), " is too large"));
    elements *= d;
    info->shape.push_back(static_cast<int64_t>(d));
  }

  const Json& begin = (*offsets_it)[0];
  const Json& end = (*offsets_it)[1];
  if (!begin.is_number_unsigned() || !end.is_number_unsigned())
    return MalformedTensor(
        path, name,
        absl::StrCat("data_offsets ", offsets_it->dump(), " are not non-negative integers"));
  const uint64_t b = begin.get<uint64_t>();
  const uint64_t e = end.get<uint64_t>();
  if (e < b)
    return MalformedTensor(path, name,
                           absl::StrCat("data_offsets [", b, ", ", e, ") end before they begin"));
  const uint64_t expected = elements * DTypeSize(info->dtype);
  if (e - b != expected)
    return MalformedTensor(
        path, name,
        absl::StrCat("data_offsets [", b, ", ", e, ") hold ", e - b, " bytes but ", dtype_name, " ",
                     ShapeString(info->shape), " needs ", expected));
  info->data_offset = b;
  info->size_bytes = e - b;
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadSmallFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return ErrnoStatus("cannot open", path, errno);
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading ", path));
  return ss.str();
}

}  // namespace

int64_t TensorInfo::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// ---- the header ---------------------------------------------------------------------------

absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(absl::Span<const uint8_t> file,
                                                         const std::string& path) {
  const uint64_t file_size = file.size();
  if (file_size < 8)
    return Malformed(
        path, absl::StrCat("file is ", file_size, " bytes, shorter than the 8-byte header length"));
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | file[i];
  if (header_len > file_size - 8 || header_len > kMaxHeaderBytes)
    return Malformed(path, absl::StrCat("header length ", header_len, " exceeds the file size (",
                                        file_size, " bytes)"));
  SafetensorsHeader out;
  out.data_start = 8 + header_len;
  const uint64_t data_size = file_size - 8 - header_len;

  absl::StatusOr<Json> parsed = ParseBoundedJson(
      absl::string_view(reinterpret_cast<const char*>(file.data()) + 8, header_len));
  if (!parsed.ok())
    return Malformed(path, absl::StrCat("header is not valid JSON: ", parsed.status().message()));
  const Json header = *std::move(parsed);
  if (!header.is_object()) return Malformed(path, "header is not a JSON object");

  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it.value().is_object()) return Malformed(path, "__metadata__ is not a JSON object");
      for (auto m = it.value().begin(); m != it.value().end(); ++m)
        out.metadata[m.key()] =
            m.value().is_string() ? m.value().get<std::string>() : m.value().dump();
      continue;
    }
    TensorInfo info;
    RETURN_IF_ERROR(ParseTensorEntry(path, it.key(), it.value(), &info));
    out.tensors.emplace(it.key(), std::move(info));
  }

  // Offsets must tile the data section without overlap or holes, and fit in it.
  std::vector<const TensorInfo*> by_offset;
  by_offset.reserve(out.tensors.size());
  for (const auto& [name, info] : out.tensors) by_offset.push_back(&info);
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return std::make_pair(a->data_offset, a->size_bytes) <
           std::make_pair(b->data_offset, b->size_bytes);
  });
  uint64_t cursor = 0;
  const TensorInfo* previous = nullptr;
  for (const TensorInfo* info : by_offset) {
    if (info->data_offset < cursor)
      return MalformedTensor(
          path, info->name,
          absl::StrCat("data_offsets [", info->data_offset, ", ",
                       info->data_offset + info->size_bytes, ") overlap tensor '", previous->name,
                       "' (ends at ", cursor, ")"));
    if (info->data_offset > cursor)
      return MalformedTensor(path, info->name,
                             absl::StrCat("data_offsets begin at ", info->data_offset,
                                          " leaving a hole after byte ", cursor));
    const uint64_t end = info->data_offset + info->size_bytes;
    if (end > data_size)
      return MalformedTensor(path, info->name,
                             absl::StrCat("data_offsets [", info->data_offset, ", ", end,
                                          ") are out of bounds: the data section has only ",
                                          data_size, " bytes (file truncated?)"));
    cursor = end;
    previous = info;
  }
  return out;
}

// ---- SafetensorsFile ----------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus("cannot open", path, errno);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return ErrnoStatus("cannot stat", path, err);
  }
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  if (file_size < 8) {  // mmap refuses empty files; the parser's message needs only the size
    ::close(fd);
    return ParseSafetensorsHeader(std::vector<uint8_t>(file_size), path).status();
  }
  void* map = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  // NOTES: the mapping keeps the file referenced; the descriptor is not needed any more.
  ::close(fd);
  if (map == MAP_FAILED) return ErrnoStatus("cannot mmap", path, map_errno);

  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  file->map_ = static_cast<const uint8_t*>(map);
  file->map_size_ = file_size;
  ASSIGN_OR_RETURN(SafetensorsHeader header,
                   ParseSafetensorsHeader(absl::MakeConstSpan(file->map_, file_size), path));
  file->data_section_ = file->map_ + header.data_start;
  file->tensors_ = std::move(header.tensors);
  file->metadata_ = std::move(header.metadata);
  return file;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(const_cast<uint8_t*>(map_), map_size_);
}

const TensorInfo* SafetensorsFile::Find(const std::string& name) const {
  const auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

absl::Span<const uint8_t> SafetensorsFile::Data(const TensorInfo& info) const {
  return absl::Span<const uint8_t>(data_section_ + info.data_offset, info.size_bytes);
}

void SafetensorsFile::Prefetch(const TensorInfo& info) const {
  if (info.size_bytes == 0) return;
  static const uintptr_t kPage = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data_section_ + info.data_offset);
  const uintptr_t aligned = begin & ~(kPage - 1);
  // Advisory only: a failure just means the pages are read at first touch instead.
  ::madvise(reinterpret_cast<void*>(aligned), begin + info.size_bytes - aligned, MADV_WILLNEED);
}

// ---- SafetensorsCheckpoint ----------------------------------------------------------------

absl::StatusOr<std::map<std::string, std::string>> ParseSafetensorsIndex(absl::string_view text,
                                                                         const std::string& what) {
  absl::StatusOr<Json> parsed = ParseBoundedJson(text);
  if (!parsed.ok())
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": not valid JSON: ", parsed.status().message()));
  const Json index = *std::move(parsed);
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
    return absl::InvalidArgumentError(absl::StrCat(what, ": missing object 'weight_map'"));
  std::map<std::string, std::string> weight_map;
  for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
    // Names come from the file: escaped and cut before they reach an error message.
    const std::string tensor = absl::CEscape(absl::string_view(it.key()).substr(0, 200));
    if (!it.value().is_string())
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": weight_map entry for '", tensor, "' is not a file name"));
    const std::string file = it.value().get<std::string>();
    // Shards live in the checkpoint directory; anything else is a malformed index.
    if (file.empty() || file == "." || file == ".." ||
        file.find_first_of(std::string("/\0", 2)) != std::string::npos)
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": weight_map entry for '", tensor, "' names '",
          absl::CEscape(absl::string_view(file).substr(0, 200)), "', not a file in the directory"));
    weight_map[it.key()] = file;
  }
  return weight_map;
}

absl::StatusOr<std::unique_ptr<SafetensorsCheckpoint>> SafetensorsCheckpoint::Open(
    const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    return absl::NotFoundError(absl::StrCat("checkpoint directory ", dir, " does not exist"));

  std::unique_ptr<SafetensorsCheckpoint> ckpt(new SafetensorsCheckpoint());
  ckpt->dir_ = dir;
  const std::string index_path = JoinPath(dir, kIndexFile);
  if (fs::exists(index_path, ec)) {
    ASSIGN_OR_RETURN(const std::string text, ReadSmallFile(index_path));
    ASSIGN_OR_RETURN(ckpt->weight_map_, ParseSafetensorsIndex(text, index_path));
    std::set<std::string> files;
    for (const auto& [tensor, file] : ckpt->weight_map_) files.insert(file);
    for (const std::string& file : files) {
      if (!fs::is_regular_file(JoinPath(dir, file), ec))
        return absl::NotFoundError(absl::StrCat("shard ", JoinPath(dir, file), " listed in ",
                                                index_path, " does not exist"));
    }
    return ckpt;
  }

  std::vector<std::string> candidates;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (it->is_regular_file(ec) && name.size() > 12 &&
        name.compare(name.size() - 12, 12, ".safetensors") == 0)
      candidates.push_back(name);
  }
  if (ec) return ErrnoStatus("cannot list", dir, ec.value());
  if (candidates.size() != 1) {
    std::sort(candidates.begin(), candidates.end());
    return absl::NotFoundError(
        candidates.empty()
            ? absl::StrCat("no ", kIndexFile, " and no *.safetensors file in ", dir)
            : absl::StrCat("no ", kIndexFile, " in ", dir, " and ", candidates.size(),
                           " *.safetensors files (", absl::StrJoin(candidates, ", "),
                           "): cannot tell which to read"));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file,
                   SafetensorsFile::Open(JoinPath(dir, candidates[0])));
  for (const auto& [name, info] : file->tensors()) ckpt->weight_map_[name] = candidates[0];
  std::lock_guard<std::mutex> lock(ckpt->shards_mu_);
  ckpt->shards_[candidates[0]] = std::move(file);
  return ckpt;
}

bool SafetensorsCheckpoint::Contains(const std::string& name) const {
  return weight_map_.count(name) > 0;
}

std::vector<std::string> SafetensorsCheckpoint::TensorNames() const {
  std::vector<std::string> names;
  names.reserve(weight_map_.size());
  for (const auto& [name, file] : weight_map_) names.push_back(name);
  return names;
}

absl::StatusOr<const SafetensorsFile*> SafetensorsCheckpoint::Shard(
    const std::string& file_name) const {
  std::lock_guard<std::mutex> lock(shards_mu_);
  auto it = shards_.find(file_name);
  if (it != shards_.end()) return it->second.get();
  // Opening under the lock: only the header is read, and concurrent loaders of the same
  // shard must not map it twice.
  ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file,
                   SafetensorsFile::Open(JoinPath(dir_, file_name)));
  const SafetensorsFile* raw = file.get();
  shards_.emplace(file_name, std::move(file));
  return raw;
}

absl::StatusOr<SafetensorsCheckpoint::Located> SafetensorsCheckpoint::Find(
    const std::string& name) const {
  const auto it = weight_map_.find(name);
  if (it == weight_map_.end())
    return absl::NotFoundError(absl::StrCat("tensor '", name, "' not found in checkpoint ", dir_));
  ASSIGN_OR_RETURN(const SafetensorsFile* file, Shard(it->second));
  const TensorInfo* info = file->Find(name);
  if (info == nullptr)
    return absl::NotFoundError(absl::StrCat("tensor '", name, "' is listed in ", kIndexFile,
                                            " but missing from ", file->path()));
  return Located{file, info};
}

absl::StatusOr<SafetensorsCheckpoint::Located> SafetensorsCheckpoint::FindChecked(
    const std::string& name, DType dtype, const std::vector<int64_t>& shape) const {
  ASSIGN_OR_RETURN(Located located, Find(name));
  if (located.info->dtype != dtype)
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' in ", located.file->path(),
                                                   ": dtype ", DTypeName(located.info->dtype),
                                                   ", expected ", DTypeName(dtype)));
  if (located.info->shape != shape)
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' in ", located.file->path(),
                                                   ": shape ", ShapeString(located.info->shape),
                                                   ", expected ", ShapeString(shape)));
  return located;
}

// ---- SafetensorsWriter --------------------------------------------------------------------

namespace {
constexpr size_t kWriteBufferBytes = 8 << 20;
}  // namespace

absl::StatusOr<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::Create(
    const std::string& path, const std::vector<PendingTensor>& tensors,
    const std::map<std::string, std::string>& metadata) {
  Json header = Json::object();
  if (!metadata.empty()) {
    Json meta = Json::object();
    for (const auto& [key, value] : metadata) meta[key] = value;
    header["__metadata__"] = std::move(meta);
  }
  uint64_t offset = 0;
  for (const PendingTensor& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__")
      return absl::InvalidArgumentError(absl::StrCat(path, ": invalid tensor name '", t.name, "'"));
    if (header.contains(t.name))
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor '", t.name, "' declared twice"));
    uint64_t elements = 1;
    for (int64_t d : t.shape) {
      if (d < 0)
        return absl::InvalidArgumentError(absl::StrCat(
            path, ": tensor '", t.name, "' has negative shape ", ShapeString(t.shape)));
      elements *= static_cast<uint64_t>(d);
    }
    const uint64_t bytes = elements * DTypeSize(t.dtype);
    header[t.name] = {{"dtype", std::string(DTypeName(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const Json::exception& e) {  // e.g. a tensor name that is not UTF-8
    return absl::InvalidArgumentError(absl::StrCat(path, ": cannot encode header: ", e.what()));
  }
  // Pad with spaces so the data section starts 8-byte aligned (as the reference writer does).
  text.append((8 - text.size() % 8) % 8, ' ');

  const std::string partial = path + ".partial";
  const int fd = ::open(partial.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus("cannot create", partial, errno);
  std::unique_ptr<SafetensorsWriter> writer(new SafetensorsWriter());
  writer->path_ = path;
  writer->partial_path_ = partial;
  writer->fd_ = fd;
  writer->expected_bytes_ = offset;
  writer->buffer_.reserve(kWriteBufferBytes);

  uint8_t length[8];
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(n >> (8 * i));
  RETURN_IF_ERROR(writer->WriteFully(length, sizeof(length)));
  RETURN_IF_ERROR(writer->WriteFully(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
  return writer;
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(partial_path_.c_str());
  }
}

absl::Status SafetensorsWriter::WriteFully(const uint8_t* data, size_t size) {
  while (size > 0) {
    const ssize_t n = ::write(fd_, data, std::min<size_t>(size, 1u << 30));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus("cannot write", path_, errno);
    }
    data += n;
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::Flush() {
  if (buffer_.empty()) return absl::OkStatus();
  RETURN_IF_ERROR(WriteFully(buffer_.data(), buffer_.size()));
  buffer_.clear();
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::Write(absl::Span<const uint8_t> bytes) {
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat(path_, ": writer is closed"));
  if (bytes.size() > expected_bytes_ - written_bytes_)
    return absl::InvalidArgumentError(
        absl::StrCat(path_, ": writing ", bytes.size(), " bytes at offset ", written_bytes_,
                     " overruns the declared ", expected_bytes_, " bytes"));
  written_bytes_ += bytes.size();
  if (buffer_.size() + bytes.size() <= kWriteBufferBytes) {
    buffer_.insert(buffer_.end(), bytes.begin(), bytes.end());
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(Flush());
  if (bytes.size() >= kWriteBufferBytes / 2) return WriteFully(bytes.data(), bytes.size());
  buffer_.insert(buffer_.end(), bytes.begin(), bytes.end());
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::Finish() {
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat(path_, ": writer is closed"));
  if (written_bytes_ != expected_bytes_)
    return absl::FailedPreconditionError(absl::StrCat(path_, ": wrote ", written_bytes_, " of the ",
                                                      expected_bytes_, " declared bytes"));
  RETURN_IF_ERROR(Flush());
  if (::fsync(fd_) != 0) return ErrnoStatus("cannot fsync", path_, errno);
  // The descriptor is gone after close() even when it fails; never close it twice.
  const int close_rc = ::close(fd_);
  const int close_errno = errno;
  fd_ = -1;
  if (close_rc != 0) {
    ::unlink(partial_path_.c_str());
    return ErrnoStatus("cannot close", partial_path_, close_errno);
  }
  if (::rename(partial_path_.c_str(), path_.c_str()) != 0) {
    const int err = errno;
    ::unlink(partial_path_.c_str());
    return ErrnoStatus("cannot rename to", path_, err);
  }
  return absl::OkStatus();
}

}  // namespace moe
