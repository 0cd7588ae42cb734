// HOST:PORT parsing and what a name stands for (core/host_port.h).
#include "core/host_port.h"

#include <algorithm>

#include "gtest/gtest.h"

namespace moe {
namespace {

TEST(HostPortTest, ParsesNamesAndBothAddressFamilies) {
  auto name = ParseHostPort("moe-gateway-control.moe.svc:50052");
  ASSERT_TRUE(name.ok());
  EXPECT_EQ(name->host, "moe-gateway-control.moe.svc");
  EXPECT_EQ(name->port, "50052");
  EXPECT_FALSE(name->literal);
  auto v4 = ParseHostPort("10.0.0.7:50052");
  ASSERT_TRUE(v4.ok());
  EXPECT_TRUE(v4->literal);
  auto v6 = ParseHostPort("[fd00::7]:50052");
  ASSERT_TRUE(v6.ok());
  EXPECT_EQ(v6->host, "fd00::7");
  EXPECT_TRUE(v6->literal);
  for (const char* bad : {"", "gateway", "gateway:", ":50052"})
    EXPECT_EQ(ParseHostPort(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
}

TEST(HostPortTest, ANameStandsForEachOfItsAddressesOnce) {
  auto loopback = ResolveHostPort("localhost:50052");
  ASSERT_TRUE(loopback.ok()) << loopback.status();
  EXPECT_NE(std::find(loopback->begin(), loopback->end(), "127.0.0.1:50052"), loopback->end());
  EXPECT_EQ(loopback->front(), "127.0.0.1:50052") << "IPv4 first";
  std::vector<std::string> sorted = *loopback;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(std::adjacent_find(sorted.begin(), sorted.end()), sorted.end()) << "no repeats";
  auto literal = ResolveHostPort("127.0.0.2:7");
  ASSERT_TRUE(literal.ok());
  EXPECT_EQ(*literal, std::vector<std::string>{"127.0.0.2:7"});
  EXPECT_EQ(ResolveHostPort("no-such-host.invalid:1").status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace moe
