// Flags: values, errors, and the generic --help / --version.
#include "core/flags.h"

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "core/version.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

absl::Status ParseArgs(Flags& flags, std::vector<std::string> args) {
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  return flags.Parse(static_cast<int>(argv.size()), argv.data());
}

TEST(FlagsTest, ValuesErrorsAndVersion) {
  int64_t port = 50051;
  std::string name;
  Flags flags("usage: tool");
  flags.Int("port", &port, "port");
  flags.String("name", &name, "name");
  EXPECT_TRUE(ParseArgs(flags, {"/usr/bin/tool", "--port", "7", "--name=x"}).ok());
  EXPECT_EQ(port, 7);
  EXPECT_EQ(name, "x");
  EXPECT_EQ(ParseArgs(flags, {"tool", "--port", "seven"}).message(),
            "--port: cannot parse 'seven'");
  EXPECT_EQ(ParseArgs(flags, {"tool", "--bogus"}).message(), "unknown flag --bogus");

  ::testing::internal::CaptureStdout();
  const absl::Status version = ParseArgs(flags, {"/usr/bin/tool", "--version"});
  const std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_TRUE(absl::IsCancelled(version));
  EXPECT_EQ(out, std::string("tool ") + Version() + " (commit " + GitCommit() + ")\n");
  EXPECT_NE(std::string(Version()), "unknown") << "the project version is compiled in";
}

TEST(FlagsTest, ChoicesTakeTheirNamesOnlyAndListThem) {
  Precision precision = Precision::kBF16;
  Flags flags("usage: tool");
  flags.Choice("dtype", &precision, PrecisionChoices(), "precision");
  EXPECT_NE(flags.Usage().find("precision (bf16, fp32) (default bf16)"), std::string::npos)
      << flags.Usage();
  EXPECT_TRUE(ParseArgs(flags, {"tool", "--dtype", "fp32"}).ok());
  EXPECT_EQ(precision, Precision::kFP32);
  EXPECT_EQ(ParseArgs(flags, {"tool", "--dtype=fp16"}).message(),
            "--dtype: 'fp16' is not one of bf16, fp32");
  EXPECT_EQ(precision, Precision::kFP32);  // unchanged by the refusal
}

TEST(FlagsTest, RangesPortsPositionalArgumentsAndFlagFiles) {
  int port = 50051, metrics = -1, threads = 0;
  double rate = 1.5;
  bool quiet = false;
  auto make = [&](Flags& flags) {
    port = 50051, metrics = -1, threads = 0, rate = 1.5, quiet = false;  // defaults again
    flags.Port("port", &port, "port");
    flags.Port("metrics-port", &metrics, "metrics", /*off=*/true);
    flags.Int("threads", &threads, "threads");
    flags.Range("threads", 0, 1024);
    flags.Double("rate", &rate, "rate");
    flags.Bool("quiet", &quiet, "quiet");
  };
  {
    Flags flags("usage: tool");
    make(flags);
    EXPECT_EQ(ParseArgs(flags, {"tool", "--port", "99999"}).message(),
              "--port must be in 0..65535, got 99999");
  }
  {
    Flags flags("usage: tool");
    make(flags);
    EXPECT_EQ(ParseArgs(flags, {"tool", "--port=1", "--threads", "-1"}).message(),
              "--threads must be in 0..1024, got -1");
  }
  {
    Flags flags("usage: tool");
    make(flags);
    EXPECT_EQ(ParseArgs(flags, {"tool", "--port", "1", "--metrics-port", "-2"}).message(),
              "--metrics-port must be in -1..65535, got -2");
  }
  {
    Flags flags("usage: tool");
    make(flags);
    EXPECT_EQ(ParseArgs(flags, {"tool", "stray"}).message(),
              "unexpected argument 'stray' (flags start with --)");
  }
  {
    Flags flags("usage: tool");
    make(flags);
    EXPECT_EQ(ParseArgs(flags, {"tool", "--rate", "nan"}).message(), "--rate: cannot parse 'nan'");
  }
  {
    Flags flags("usage: tool");
    make(flags);
    flags.AllowPositional();
    ASSERT_TRUE(ParseArgs(flags, {"tool", "a", "--quiet", "b"}).ok());
    EXPECT_EQ(flags.positional(), (std::vector<std::string>{"a", "b"}));
    EXPECT_TRUE(quiet);
  }
  // A flag file: one flag per line, "=" or a space, comments; later flags win.
  const std::string path = ::testing::TempDir() + "flags_test.flags";
  {
    std::ofstream(path) << "# a comment\n--port=7001\n\n  --threads 3\n--quiet=false\n";
    Flags flags("usage: tool");
    make(flags);
    quiet = true;  // the file's --quiet=false must win over this
    ASSERT_TRUE(ParseArgs(flags, {"tool", "--flagfile", path, "--threads=4"}).ok());
    EXPECT_EQ(port, 7001);
    EXPECT_EQ(threads, 4);
    EXPECT_FALSE(quiet);
  }
  {
    std::ofstream(path) << "--port=70000\n";
    Flags flags("usage: tool");
    make(flags);
    EXPECT_EQ(ParseArgs(flags, {"tool", "--flagfile=" + path}).message(),
              "--port must be in 0..65535, got 70000");
    EXPECT_EQ(ParseArgs(flags, {"tool", "--flagfile", path + ".missing"}).message(),
              "--flagfile: cannot read " + path + ".missing");
  }
  std::remove(path.c_str());
  {
    Flags flags("usage: tool");
    make(flags);
    ::testing::internal::CaptureStdout();
    const absl::Status help = ParseArgs(flags, {"tool", "--helpfull"});
    const std::string out = ::testing::internal::GetCapturedStdout();
    EXPECT_TRUE(absl::IsCancelled(help));
    EXPECT_NE(out.find("--metrics-port"), std::string::npos) << out;
    EXPECT_NE(out.find("[-1..65535]"), std::string::npos) << out;
  }
}

}  // namespace
}  // namespace moe
