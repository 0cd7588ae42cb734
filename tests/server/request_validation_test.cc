// Forward request validation: one precise status per kind of bad input.
#include "server/gateway/request_validation.h"

#include <cmath>

#include "server/gateway/kserve_codec.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

moe::v1::ForwardRequest Request(int layer, std::vector<int64_t> shape,
                                moe::v1::DType dtype = moe::v1::FP32) {
  moe::v1::ForwardRequest r;
  r.set_layer(layer);
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<float> values(n);
  for (int64_t i = 0; i < n; ++i) values[i] = 0.25f * static_cast<float>(i % 13) - 1.0f;
  EXPECT_TRUE(EncodeTensor(values.data(), shape, dtype, r.mutable_hidden_states()).ok());
  return r;
}

const RequestLimits kLimits{8, 16, {1, 2}};

TEST(RequestValidationTest, AcceptsEveryDtypeAndBothShapes) {
  for (auto dtype : {moe::v1::BF16, moe::v1::FP16, moe::v1::FP32}) {
    auto v = ValidateForwardRequest(Request(1, {3, 8}, dtype), kLimits);
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ(v->tokens, 3);
    EXPECT_EQ(v->output_dtype, dtype);
    EXPECT_EQ(v->input.Value(1), -0.75f);               // exact in every dtype
    EXPECT_EQ(v->input.precision(), Precision::kBF16);  // the layers' dtype, whatever was sent
  }
  auto v = ValidateForwardRequest(Request(2, {2, 4, 8}), kLimits);
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(v->tokens, 8);
}

TEST(RequestValidationTest, RejectsBadInputWithPreciseCodes) {
  EXPECT_EQ(ValidateForwardRequest(Request(3, {1, 8}), kLimits).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(ValidateForwardRequest(Request(1, {1, 9}), kLimits).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateForwardRequest(Request(1, {8}), kLimits).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateForwardRequest(Request(1, {0, 8}), kLimits).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateForwardRequest(Request(1, {17, 8}), kLimits).status().code(),
            absl::StatusCode::kResourceExhausted);
  {
    moe::v1::ForwardRequest huge;  // shape claims 2^60 tokens, no data: no overflow, no allocation
    huge.set_layer(1);
    huge.mutable_hidden_states()->set_dtype(moe::v1::FP32);
    for (int64_t d : {int64_t{1} << 30, int64_t{1} << 30, int64_t{8}})
      huge.mutable_hidden_states()->add_shape(d);
    EXPECT_EQ(ValidateForwardRequest(huge, kLimits).status().code(),
              absl::StatusCode::kResourceExhausted);
  }
  auto r = Request(1, {2, 8});
  r.mutable_hidden_states()->mutable_data()->pop_back();
  EXPECT_EQ(ValidateForwardRequest(r, kLimits).status().code(), absl::StatusCode::kInvalidArgument);
  r = Request(1, {2, 8});
  r.mutable_hidden_states()->set_dtype(moe::v1::DTYPE_UNSPECIFIED);
  EXPECT_EQ(ValidateForwardRequest(r, kLimits).status().code(), absl::StatusCode::kInvalidArgument);
  for (float bad : {NAN, INFINITY, -INFINITY}) {
    std::vector<float> x(16, 0.5f);
    x[11] = bad;
    moe::v1::ForwardRequest req;
    req.set_layer(1);
    ASSERT_TRUE(EncodeTensor(x.data(), {2, 8}, moe::v1::FP32, req.mutable_hidden_states()).ok());
    auto s = ValidateForwardRequest(req, kLimits).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("token 1, feature 3"), std::string::npos) << s.message();
  }
  moe::v1::ForwardRequest empty;
  empty.set_layer(1);
  EXPECT_EQ(ValidateForwardRequest(empty, kLimits).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(RequestValidationTest, MessagesNameWhatWasSentAndIdsStayIds) {
  auto r = Request(1, {2, 8});
  r.mutable_hidden_states()->set_dtype(static_cast<moe::v1::DType>(77));
  absl::Status s = ValidateForwardRequest(r, kLimits).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("dtype 77 (not a DType value) is not supported"), std::string::npos)
      << s.message();
  r = Request(1, {2, 8});
  r.set_output_dtype(static_cast<moe::v1::DType>(-3));
  s = ValidateForwardRequest(r, kLimits).status();
  EXPECT_NE(s.message().find("output_dtype -3 (not a DType value)"), std::string::npos)
      << s.message();
  r = Request(1, {2, 8});
  r.set_request_id(std::string(kMaxRequestIdBytes, 'i'));
  EXPECT_TRUE(ValidateForwardRequest(r, kLimits).ok());
  r.set_request_id(std::string(10 << 20, 'i'));
  s = ValidateForwardRequest(r, kLimits).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "request_id is 10485760 bytes, more than the 256 echoed back");
}

TEST(RequestValidationTest, KServeModelNamesHaveOneSpelling) {
  EXPECT_EQ(*KServeModelLayer("moe-layer-1"), 1);
  EXPECT_EQ(*KServeModelLayer("moe-layer-60"), 60);
  EXPECT_EQ(*KServeModelLayer("moe-layer-0"), 0);
  for (const char* name : {"moe-layer-01", "moe-layer-001", "moe-layer-+1", "moe-layer- 1",
                           "moe-layer-", "moe-layer-1x", "moe-layer-9999999999"})
    EXPECT_EQ(KServeModelLayer(name).status().code(), absl::StatusCode::kNotFound) << name;
}

// The decoded rows are the layer's input: fp32/fp16 sent to a bf16 layer rounded once (to
// nearest even), bf16 taken as sent, and an fp32 layer keeps fp32 bits.
TEST(RequestValidationTest, DecodesIntoTheLayersDtype) {
  std::vector<float> x(8);
  for (int i = 0; i < 8; ++i) x[i] = 1.0f + static_cast<float>(i) * 0x1p-9f - 0.3f * i;
  x[1] = 1.0f + 0x1p-8f;  // a tie: rounds to 1.0 in bf16
  moe::v1::ForwardRequest r;
  r.set_layer(1);
  ASSERT_TRUE(EncodeTensor(x.data(), {1, 8}, moe::v1::FP32, r.mutable_hidden_states()).ok());
  auto bf16 = ValidateForwardRequest(r, kLimits);
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  ASSERT_EQ(bf16->input.precision(), Precision::kBF16);
  EXPECT_EQ(bf16->input.Value(1), 1.0f);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(bf16->input.bf16()[i], FloatToBf16Bits(x[i])) << i;

  RequestLimits fp32_limits = kLimits;
  fp32_limits.precision = Precision::kFP32;
  auto fp32 = ValidateForwardRequest(r, fp32_limits);
  ASSERT_TRUE(fp32.ok()) << fp32.status();
  ASSERT_EQ(fp32->input.precision(), Precision::kFP32);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(fp32->input.Value(i), x[i]) << i;

  moe::v1::ForwardRequest b;
  b.set_layer(1);
  ASSERT_TRUE(EncodeTensor(x.data(), {1, 8}, moe::v1::BF16, b.mutable_hidden_states()).ok());
  auto sent_bf16 = ValidateForwardRequest(b, kLimits);
  ASSERT_TRUE(sent_bf16.ok());
  EXPECT_TRUE(sent_bf16->input == bf16->input);
}

// A finite fp32 value that a bf16 layer cannot hold is the caller's error, named as such (the
// fp32 layer takes it).
TEST(RequestValidationTest, Fp32BeyondBf16RangeIsRejectedByABf16Layer) {
  std::vector<float> x(16, 0.5f);
  x[10] = 3.4e38f;
  moe::v1::ForwardRequest r;
  r.set_layer(1);
  ASSERT_TRUE(EncodeTensor(x.data(), {2, 8}, moe::v1::FP32, r.mutable_hidden_states()).ok());
  const absl::Status s = ValidateForwardRequest(r, kLimits).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("(token 1, feature 2) is beyond bf16's range"), std::string::npos)
      << s.message();
  RequestLimits fp32_limits = kLimits;
  fp32_limits.precision = Precision::kFP32;
  EXPECT_TRUE(ValidateForwardRequest(r, fp32_limits).ok());
}

// [T, 2^62, H]: the token count stops at the limit instead of overflowing int64.
TEST(RequestValidationTest, TokenCountCannotOverflow) {
  moe::v1::ForwardRequest huge;
  huge.set_layer(1);
  huge.mutable_hidden_states()->set_dtype(moe::v1::FP32);
  for (int64_t d : {int64_t{16}, int64_t{1} << 62, int64_t{8}})
    huge.mutable_hidden_states()->add_shape(d);
  const absl::Status s = ValidateForwardRequest(huge, kLimits).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(s.message(), "request has more tokens than the limit of 16 per request");
  // The limit itself is still accepted, one more is not.
  EXPECT_TRUE(ValidateForwardRequest(Request(1, {2, 8, 8}), kLimits).ok());
  EXPECT_EQ(ValidateForwardRequest(Request(1, {17, 1, 8}), kLimits).status().code(),
            absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace moe
