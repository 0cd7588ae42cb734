// Progress: lines on a log, a bar on a terminal, ratio and the gauge hook.
#include "core/progress.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace moe {
namespace {

TEST(ProgressTest, LinesOnALogWithRateAndEtaAndNoCarriageReturns) {
  std::vector<double> ratios;
  ::testing::internal::CaptureStderr();
  {
    Progress progress("moe-rank 2: loading experts", 4000000000);
    progress.set_terminal(false);
    progress.set_interval(std::chrono::milliseconds(0));
    progress.on_ratio = [&](double r) { ratios.push_back(r); };
    progress.Add(1000000000, "layer 1 (1/4)");
    progress.Add(1000000000, "layer 2 (2/4)");
    EXPECT_DOUBLE_EQ(progress.ratio(), 0.5);
    progress.Finish();
  }
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(err.find('\r'), std::string::npos) << err;
  EXPECT_NE(err.find("moe-rank 2: loading experts layer 1 (1/4): 1.00 GB of 4.00 GB (25%), "),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("layer 2 (2/4): 2.00 GB of 4.00 GB (50%)"), std::string::npos) << err;
  EXPECT_NE(err.find("ETA "), std::string::npos) << err;
  EXPECT_NE(err.find("moe-rank 2: loading experts: 2.00 GB in "), std::string::npos) << err;
  EXPECT_EQ(ratios, (std::vector<double>{0.25, 0.5, 1.0}));
}

TEST(ProgressTest, ABarOnATerminalAndSilenceWhenDisabledOrIdle) {
  ::testing::internal::CaptureStderr();
  {
    Progress progress("moe-ckpt: writing", 100);
    progress.set_terminal(true);
    progress.set_interval(std::chrono::milliseconds(0));
    progress.Add(50);
    progress.Finish();
  }
  std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(err.rfind("\rmoe-ckpt: writing: 0 kB of 0 kB (50%)", 0), 0u) << err;
  EXPECT_EQ(err.back(), '\n');

  ::testing::internal::CaptureStderr();
  {
    Progress quiet("quiet", 100, /*enabled=*/false);
    quiet.set_interval(std::chrono::milliseconds(0));
    quiet.Add(100);
    quiet.Finish();
    Progress idle("idle", 0);
    idle.Finish();  // nothing was done: no line
  }
  err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(err, "");
}

}  // namespace
}  // namespace moe
