// The shared command-line parser (tools/cli/cli.h), kiln-train's main.py spelling and launch
// mapping (tools/train/trainer.h), and every tool binary's message for a bad value, a bad
// launcher variable or a file or folder the user named: one line ("<tool>: error: <flag>
// '<value>': expected ..."), no source location, exit code 1; output that cannot be written is
// exit code 1 too.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "core/device_query.h"
#include "core/generator.h"
#include "core/json.h"
#include "core/serialization.h"
#include "data/image.h"
#include "tools/cli/cli.h"
#include "tools/train/output_dir.h"
#include "tools/train/train_data.h"
#include "tools/train/train_dist.h"
#include "tools/train/trainer.h"

using namespace kiln;
namespace fs = std::filesystem;

namespace {

struct Flags {
  bool quiet = false;
  std::string name = "x";
  int64_t n = 3;
  int small = 2;
  uint64_t seed = 0;
  double lr = 0.5, frac = 0.0;
  std::string mode = "a";
  std::vector<int64_t> list = {1, 2};
  std::vector<std::string> pos;
};

// A parser over `f` with one flag of each kind.
cli::Parser make(Flags& f, size_t max_pos = 2) {
  cli::Parser p("tool", "[flags] [FILE...]", "A test tool.");
  p.positional("FILE", &f.pos, "inputs", 0, max_pos);
  p.flag("-q, --quiet", &f.quiet, "quiet");
  p.value("--name", "S", &f.name, "a name");
  p.value("-n, --count", "N", &f.n, "a count", 1);
  p.value("-j, --workers", "N", &f.small, "workers", 0, 16);
  p.value("--seed", "N", &f.seed, "seed");
  p.value("--lr, --learning-rate", "LR", &f.lr, "rate", 0.0);
  p.value("--frac", "F", &f.frac, "fraction", 0.0, 1.0, cli::Upper::Open);
  p.choice("--mode", &f.mode, {"a", "b"}, "mode");
  p.list("--sizes", "L", &f.list, "sizes", 1);
  return p;
}

// The UsageError message of parsing `args`, or "" when it parses.
std::string error_of(const std::vector<std::string>& args) {
  Flags f;
  cli::Parser p = make(f);
  try {
    p.parse(args);
  } catch (const cli::UsageError& e) {
    return e.what();
  }
  return "";
}

struct Run {
  int code = -1;
  std::string output;  // stdout and stderr
};

// Runs a tool built beside this test binary, e.g. tool("kiln-convert", "--num-classes abc"), with
// `env` ("NAME=VALUE ...") added to its environment.
Run tool(const std::string& name, const std::string& args, const std::string& env = "") {
  const fs::path dir = fs::read_symlink("/proc/self/exe").parent_path();
  const fs::path exe = dir / name;
  REQUIRE_MESSAGE(fs::exists(exe), exe.string(), " is missing: build the tools first");
  Run r;
  std::FILE* p = ::popen(("env " + env + " " + exe.string() + " " + args + " 2>&1").c_str(), "r");
  REQUIRE(p != nullptr);
  std::array<char, 4096> buf;
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  const int status = ::pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// Whether `output` ends with the line `last` (progress lines may come before it).
bool lines_end_with(const std::string& output, const std::string& last) {
  return output.size() >= last.size() &&
         output.compare(output.size() - last.size(), last.size(), last) == 0 &&
         (output.size() == last.size() || output[output.size() - last.size() - 1] == '\n');
}

}  // namespace

TEST_CASE("cli::Parser: spellings, values, positionals") {
  Flags f;
  cli::Parser p = make(f);
  CHECK(p.parse({"in.png", "-q", "--name=abc", "-n", "7", "-j4", "--seed", "18446744073709551615",
                 "--learning-rate", "0.25", "--frac=0.5", "--mode", "b", "--sizes", "3,4,5", "--",
                 "-odd-name"}));
  CHECK(f.quiet);
  CHECK(f.name == "abc");
  CHECK(f.n == 7);
  CHECK(f.small == 4);
  CHECK(f.seed == 18446744073709551615ull);
  CHECK(f.lr == 0.25);
  CHECK(f.frac == 0.5);
  CHECK(f.mode == "b");
  CHECK(f.list == std::vector<int64_t>{3, 4, 5});
  CHECK(f.pos == std::vector<std::string>{"in.png", "-odd-name"});
  CHECK(p.given("--lr"));
  CHECK(p.given("-n"));
  CHECK(p.given("--frac"));

  Flags g;
  cli::Parser q = make(g);
  CHECK(q.parse({"-n", "2", "--count", "5"}));  // the last one wins
  CHECK(g.n == 5);
  CHECK_FALSE(q.given("--name"));
  CHECK(q.parse({"--lr", "1e-3"}));  // a value may look like anything
  CHECK(g.lr == 0.001);

  Flags h;
  cli::Parser r = make(h);
  CHECK_FALSE(r.parse({"--name", "z", "--help"}));  // help: false, the rest still parsed
  CHECK(h.name == "z");
}

TEST_CASE("cli::Parser: every mistake names the flag, the value and what is allowed") {
  CHECK(error_of({"--bogus"}) == "unknown flag '--bogus' (see tool --help)");
  CHECK(error_of({"-x"}) == "unknown flag '-x' (see tool --help)");
  CHECK(error_of({"--count"}) == "flag --count needs a value (N)");
  CHECK(error_of({"-n", "abc"}) == "-n 'abc': expected an integer >= 1");
  CHECK(error_of({"--count", "0"}) == "--count '0': expected an integer >= 1");
  CHECK(error_of({"--count", "3.5"}) == "--count '3.5': expected an integer >= 1");
  CHECK(error_of({"--count", "99999999999999999999"}) ==
        "--count '99999999999999999999': expected an integer >= 1");
  CHECK(error_of({"-j", "17"}) == "-j '17': expected an integer between 0 and 16");
  CHECK(error_of({"--seed", "-1"}) == "--seed '-1': expected an integer >= 0");
  CHECK(error_of({"--lr", "fast"}) == "--lr 'fast': expected a number >= 0");
  CHECK(error_of({"--learning-rate", "-1"}) == "--learning-rate '-1': expected a number >= 0");
  CHECK(error_of({"--lr", "nan"}) == "--lr 'nan': expected a number >= 0");
  CHECK(error_of({"--frac", "1"}) == "--frac '1': expected a number >= 0 and < 1");
  CHECK(error_of({"--mode", "c"}) == "--mode 'c': expected one of a, b");
  CHECK(error_of({"--sizes", "3,,4"}) ==
        "--sizes '3,,4': expected comma-separated integers >= 1 (bad item '')");
  CHECK(error_of({"--name="}) == "--name '': expected a non-empty value");
  CHECK(error_of({"--quiet=yes"}) == "flag --quiet takes no value, got 'yes'");
  CHECK(error_of({"a", "b", "c"}) == "unexpected argument 'c' (tool takes at most 2 FILE)");
  // Messages carry no source location.
  CHECK(error_of({"--count", "0"}).find(".cpp") == std::string::npos);
}

TEST_CASE("cli::Parser: --help lists every spelling and the defaults") {
  Flags f;
  cli::Parser p = make(f);
  const std::string h = p.help();
  CHECK(h.find("usage: tool [flags] [FILE...]") == 0);
  CHECK(h.find("-n, --count N") != std::string::npos);
  CHECK(h.find("--lr, --learning-rate LR") != std::string::npos);
  CHECK(h.find("a count (default 3)") != std::string::npos);
  CHECK(h.find("--mode a|b") != std::string::npos);
  CHECK(h.find("(default 1,2)") != std::string::npos);
  CHECK(h.find("-h, --help") != std::string::npos);
}

TEST_CASE("cli::Parser: --version and --help end the run with info()") {
  Flags f;
  cli::Parser p = make(f);
  p.version("tool 1.2.3 (test build)");
  CHECK_FALSE(p.parse({"--version", "in.png", "extra", "more"}));  // positionals not enforced
  CHECK(p.info() == "tool 1.2.3 (test build)\n");
  Flags g;
  cli::Parser q = make(g);
  q.version("tool 1.2.3");
  CHECK_FALSE(q.parse({"-h"}));
  CHECK(q.info() == q.help());
  CHECK(q.help().find("--version") != std::string::npos);
  CHECK_THROWS_AS(q.parse({"--version", "--count", "0"}), cli::UsageError);  // still checked
}

TEST_CASE("cli::without_location drops kiln::Error's locations, wherever they stand") {
  CHECK(cli::without_location("bad file 'x' [core/serialization.cpp:12, check failed: ok]") ==
        "bad file 'x'");
  CHECK(cli::without_location("bad [tools/a.cpp:7]") == "bad");
  CHECK(cli::without_location("list [1, 2]") == "list [1, 2]");
  CHECK(cli::without_location("plain") == "plain");
  CHECK(cli::without_location("shape [2, 3] at [x.cpp:]") == "shape [2, 3] at [x.cpp:]");
  // A message wrapping another's what(): the inner location goes too, nested brackets and all.
  CHECK(cli::without_location("'f': optimizer state: unexpected key 'a' [optim/fused.cpp:180, "
                              "check failed: live.count(key[0])]: resume elsewhere "
                              "[tools/train/trainer.cpp:9]") ==
        "'f': optimizer state: unexpected key 'a': resume elsewhere");
}

TEST_CASE("kiln-train: PyTorch ImageNet example's spelling") {
  bool help = true;
  train::Config c = train::parse_args({"/data/imagenet",
                                       "-a",
                                       "resnet50",
                                       "-j",
                                       "8",
                                       "--epochs",
                                       "90",
                                       "--start-epoch",
                                       "3",
                                       "-b",
                                       "256",
                                       "--learning-rate",
                                       "0.1",
                                       "--momentum",
                                       "0.8",
                                       "--weight-decay",
                                       "1e-4",
                                       "-p",
                                       "10",
                                       "-e",
                                       "--pretrained",
                                       "w.safetensors",
                                       "--seed",
                                       "7",
                                       "--gpu",
                                       "1",
                                       "--nesterov",
                                       "--freeze-backbone"},
                                      &help);
  CHECK_FALSE(help);
  CHECK(c.data == "/data/imagenet");
  CHECK(c.arch == "resnet50");
  CHECK(c.workers == 8);
  CHECK(c.epochs == 90);
  CHECK(c.start_epoch == 3);
  CHECK(c.batch_size == 256);
  CHECK(c.lr == 0.1);
  CHECK(c.momentum == 0.8);
  CHECK(c.wd == 1e-4);
  CHECK(c.print_freq == 10);
  CHECK(train::parse_args({"--resume", "ck.safetensors", "-e"}).resume == "ck.safetensors");
  CHECK(c.evaluate);
  CHECK(c.pretrained == "w.safetensors");
  CHECK(c.seed == 7);
  CHECK(c.device == "cuda:1");
  CHECK(c.nesterov);
  CHECK(c.freeze_backbone);

  train::Config d = train::parse_args({"--dummy", "--dummy-images", "640"});
  CHECK(d.dummy);
  CHECK(d.dummy_images == 640);

  // Contradictions are refused with a reason.
  auto msg = [](const std::vector<std::string>& a) {
    try {
      train::parse_args(a);
    } catch (const cli::UsageError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK(msg({"a", "--data", "b"}) == "DATA 'a' and --data 'b' disagree; give one");
  CHECK(msg({"--gpu", "1", "--device", "cpu"}) == "--gpu 1 and --device cpu disagree; give one");
  CHECK(msg({"--dummy", "dir"}) == "--dummy replaces DATA 'dir'; give one");
  CHECK(msg({"--freeze-backbone"}).find("give --pretrained PATH") != std::string::npos);
  CHECK(msg({"--pretrained", "a", "--weights", "b"}).find("give one") != std::string::npos);
  CHECK(msg({"--resume", "a", "--pretrained", "b"}) ==
        "--resume and --pretrained both name starting weights (--resume continues a run with its "
        "own); give one");
  CHECK(msg({"--epochs", "2", "--start-epoch", "2"}) ==
        "--start-epoch 2: must be below --epochs 2");
  CHECK(msg({"--rank", "1"}) == "--rank 1 needs --world-size");
  CHECK(msg({"-b", "0"}) == "-b '0': expected an integer between 1 and 1048576");
  // A batch whose element count would overflow (it crashed --dummy) is refused by its flag.
  CHECK(msg({"-b", "4611686018427387904"}) ==
        "-b '4611686018427387904': expected an integer between 1 and 1048576");
  CHECK(msg({"--gpu", "-1"}) == "--gpu '-1': expected an integer >= 0");
  // The multi-GPU command of main.py's README.
  train::Config m = train::parse_args({"-a", "resnet50", "--dist-url", "tcp://127.0.0.1:29501",
                                       "--dist-backend", "nccl", "--multiprocessing-distributed",
                                       "--world-size", "1", "--rank", "0", "/data/imagenet"});
  CHECK(m.multiprocessing_distributed);
  CHECK(m.data == "/data/imagenet");
  CHECK(train::launch_env(m).empty());  // one node: the launcher sets each child's variables
  CHECK(msg({"--dist-backend", "gloo"}) == "--dist-backend 'gloo': expected one of nccl");
  CHECK(msg({"--multiprocessing-distributed", "--nproc", "2"}).find("give one") !=
        std::string::npos);
  if (!train::data_parallel_available()) CHECK(train::main({"--multiprocessing-distributed"}) == 1);
  const std::string u = train::usage();
  CHECK(u.find("PER PROCESS") != std::string::npos);
  CHECK(u.find("--lr, --learning-rate LR") != std::string::npos);
  CHECK(u.find("-e, --evaluate") != std::string::npos);
}

TEST_CASE("kiln-train: --world-size/--rank/--dist-url/--gpu map onto torchrun's variables") {
  using Env = std::vector<std::pair<std::string, std::string>>;
  CHECK(train::launch_env(train::parse_args({})).empty());
  CHECK(train::launch_env(train::parse_args(
            {"--world-size", "4", "--rank", "2", "--dist-url", "tcp://10.0.0.1:23456"})) ==
        Env{{"WORLD_SIZE", "4"},
            {"RANK", "2"},
            {"LOCAL_RANK", "2"},
            {"MASTER_ADDR", "10.0.0.1"},
            {"MASTER_PORT", "23456"}});
  CHECK(train::launch_env(train::parse_args(
            {"--world-size", "2", "--rank", "1", "--gpu", "0", "--dist-url", "tcp://h:1"}))[2] ==
        std::pair<std::string, std::string>{"LOCAL_RANK", "0"});
  CHECK(train::launch_env(train::parse_args({"--world-size", "1"})).empty());  // one process
  auto msg = [](const std::vector<std::string>& a) {
    try {
      train::launch_env(train::parse_args(a));
    } catch (const cli::UsageError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK(msg({"--world-size", "2", "--rank", "2", "--dist-url", "tcp://h:1"}) ==
        "--rank 2: must be below --world-size 2");
  const std::string expected =
      "': expected tcp://HOST:PORT (port 1..65535; IPv6: tcp://[::1]:PORT) or env://";
  for (const char* url : {"udp://h:1", "tcp://h:99999", "tcp://h:0", "tcp://h:", "tcp://:1",
                          "tcp://h:+1", "tcp://h: 1", "tcp://h:1x", "tcp://h", "tcp://[::1]",
                          "tcp://[::1]29500", "tcp://[]:1", "tcp://[::1]:", "tcp://h/x:1"}) {
    INFO(url);
    CHECK(msg({"--world-size", "2", "--dist-url", url}) ==
          std::string("--dist-url '") + url + expected);
  }
  // IPv6: in brackets, and MASTER_ADDR gets the address bare (as PyTorch's init_method).
  CHECK(msg({"--world-size", "2", "--dist-url", "tcp://::1:29500"}) ==
        "--dist-url 'tcp://::1:29500': an IPv6 address goes in brackets, tcp://[ADDRESS]:PORT");
  CHECK(train::launch_env(train::parse_args(
            {"--world-size", "2", "--rank", "0", "--dist-url", "tcp://[fd00::2]:29500"})) ==
        Env{{"WORLD_SIZE", "2"},
            {"RANK", "0"},
            {"LOCAL_RANK", "0"},
            {"MASTER_ADDR", "fd00::2"},
            {"MASTER_PORT", "29500"}});
  CHECK(train::launch_env(
            train::parse_args({"--world-size", "2", "--dist-url", "tcp://[::1]:1"}))[3] ==
        std::pair<std::string, std::string>{"MASTER_ADDR", "::1"});
  CHECK(msg({"--world-size", "2", "--multiprocessing-distributed", "--dist-url", "tcp://h:1"})
            .find("launches the processes of one node only") != std::string::npos);
  CHECK(msg({"--world-size", "2", "--nproc", "2", "--dist-url", "tcp://h:1"}).find("give one") !=
        std::string::npos);
}

TEST_CASE("kiln-train, kiln-bench: the launcher's variables, one line each; stray ones ignored") {
  const fs::path out = fs::temp_directory_path() / ("kiln_test_cli_" + std::to_string(::getpid()));
  const std::string no_data = "--data /nonexistent/kiln-data --device cpu --quiet";
  const std::string data_error = "kiln-train: error: --data '/nonexistent/kiln-data'";
  // One process: MASTER_ADDR/MASTER_PORT/KILN_RDZV_PORT are not read, whatever they hold, and
  // the run goes on (to the missing data).
  Run r = tool("kiln-train", no_data, "MASTER_ADDR= MASTER_PORT=garbage KILN_RDZV_PORT=-5");
  CHECK(r.code == 1);
  CHECK(r.output.rfind(data_error, 0) == 0);
  CHECK(r.output.find('\n') == r.output.size() - 1);
  r = tool("kiln-train", no_data, "WORLD_SIZE=1 RANK=0 MASTER_PORT=99999");
  CHECK(r.output.rfind(data_error, 0) == 0);
  // A stray WORLD_SIZE=1 in an 8-task Slurm job: one warning naming both (though kiln-train
  // reads its place more than once), then the run as WORLD_SIZE says.
  r = tool("kiln-train", no_data, "WORLD_SIZE=1 SLURM_NTASKS=8 SLURM_PROCID=3");
  CHECK(r.output.rfind("kiln: warning: WORLD_SIZE=1 and SLURM_NTASKS=8 disagree; WORLD_SIZE takes "
                       "precedence, so this process is rank 0 of 1\n" +
                           data_error,
                       0) == 0);
  CHECK(std::count(r.output.begin(), r.output.end(), '\n') == 2);
  // More than one process: a bad value is one line naming it, without a source location.
  r = tool("kiln-train", no_data, "WORLD_SIZE=2 RANK=0 MASTER_ADDR=h MASTER_PORT=garbage");
  CHECK(r.code == 1);
  CHECK(r.output ==
        "kiln-train: error: environment variable MASTER_PORT='garbage': expected an integer "
        "between 1 and 65535\n");
  r = tool("kiln-train", no_data, "OMPI_COMM_WORLD_SIZE=2 OMPI_COMM_WORLD_RANK=0 MASTER_PORT=1");
  CHECK(r.output ==
        "kiln-train: error: environment variable MASTER_ADDR is not set but OMPI_COMM_WORLD_SIZE=2 "
        "(under mpirun: export it, then mpirun -x MASTER_ADDR -x MASTER_PORT ...)\n");
  r = tool("kiln-train", "--world-size 2 --rank 1 --dist-url tcp://::1:29500 " + no_data);
  CHECK(r.output ==
        "kiln-train: error: --dist-url 'tcp://::1:29500': an IPv6 address goes in brackets, "
        "tcp://[ADDRESS]:PORT\n");
  r = tool("kiln-bench", "--ops", "WORLD_SIZE=4 RANK=4");
  CHECK(r.code == 1);
  CHECK(r.output ==
        "kiln-bench: error: environment variable RANK='4': expected an integer between 0 and 3 "
        "(below WORLD_SIZE=4)\n");
  // Without NCCL, a job of several processes stops at the data-parallel setup, in one line.
  if (!train::data_parallel_available()) {
    r = tool("kiln-train",
             "--dummy --dummy-images 64 -a resnet_small --width 8 --image-size 16 -b 32 "
             "--device cpu --quiet --output " +
                 out.string(),
             "WORLD_SIZE=2 RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=1");
    CHECK(r.code == 1);
    CHECK(r.output ==
          "kiln-train: error: this process is rank 0 of 2 (local rank 0), launched by RANK/"
          "WORLD_SIZE variables: data-parallel training needs a kiln built with CUDA and NCCL\n");
  }
  std::error_code ec;
  fs::remove_all(out, ec);
}

TEST_CASE("kiln-train's --output, kiln-bench, kiln-loader-bench: refusals are one line") {
  const fs::path root =
      fs::temp_directory_path() / ("kiln_test_cli_out_" + std::to_string(::getpid()));
  fs::create_directories(root);
  auto claim = [](const fs::path& dir, train::OutputReuse reuse) {
    try {
      train::OutputDir out(train::plan_output(dir.string(), reuse, {}));
    } catch (const cli::UsageError& e) {
      return std::string(e.what());
    } catch (const std::exception& e) {
      return std::string("(not a UsageError) ") + e.what();
    }
    return std::string();
  };
  const fs::path file = root / "a-file";
  std::ofstream(file) << "x";
  CHECK(claim(file, train::OutputReuse::New) ==
        "--output '" + file.string() + "' exists and is not a folder");
  CHECK(claim(file / "sub", train::OutputReuse::New) ==
        "--output '" + (file / "sub").string() + "': cannot create the folder: Not a directory");
  CHECK(claim("/proc/self", train::OutputReuse::New).rfind(
            "--output '/proc/self' is not empty (it holds ", 0) == 0);
  const std::string proc = claim("/proc/self", train::OutputReuse::Overwrite);
  CHECK(proc.rfind("--output '/proc/self' is not writable: cannot create '/proc/self/", 0) == 0);
  CHECK(cli::without_location(proc) == proc);
  const fs::path run = root / "run";
  fs::create_directories(run);
  std::ofstream(run / "log.jsonl") << "{}\n";
  CHECK(claim(run, train::OutputReuse::New) ==
        "--output '" + run.string() + "' already holds a run (log.jsonl); pass --resume " +
            (run / "checkpoint.safetensors").string() +
            " to continue it, --overwrite to replace it, or choose another --output");
  {
    train::OutputDir running(train::OutputPlan{run.string(), train::OutputReuse::Overwrite});
    CHECK(claim(run, train::OutputReuse::Overwrite) ==
          "--output '" + run.string() + "' is in use by a running kiln-train (pid " +
              std::to_string(::getpid()) + "); choose another --output or wait for it to finish");
  }
  CHECK(claim(run, train::OutputReuse::Overwrite) == "");  // the lock went with its holder

  if (!built_with_cuda()) {
    Run r = tool("kiln-bench", "--model resnet50");
    CHECK(r.code == 1);
    CHECK(r.output ==
          "kiln-bench: error: --model measures the GPU backend, and this kiln was built "
          "without CUDA\n");
    r = tool("kiln-bench", "--model resnet50 --verify-graph");
    CHECK(r.output ==
          "kiln-bench: error: --verify-graph compares CUDA graph replay with eager "
          "steps on the GPU, and this kiln was built without CUDA\n");
  }
  if (built_with_cuda() && !cuda_available()) {  // CUDA built in, no GPU: one line, no location
    for (const char* what : {"--model", "--verify-graph"}) {
      const Run r = tool("kiln-bench", std::string("--model resnet18") +
                                           (std::string(what) == "--model" ? "" : " --verify-graph"));
      CHECK(r.code == 1);
      CHECK(r.output == "kiln-bench: error: " + std::string(what) +
                            " runs on a CUDA device, and no CUDA device is visible\n");
    }
  }
  {  // --trace-kernels: its flag combinations, before any device is needed
    const std::string trace = " --trace-kernels " + (root / "trace.csv").string();
    Run t = tool("kiln-bench", "--ops" + trace);
    CHECK(t.code == 1);
    CHECK(t.output == "kiln-bench: error: --trace-kernels needs --model NAME\n");
    t = tool("kiln-bench", "--model resnet50 --batches 64,256" + trace);
    CHECK(t.code == 1);
    CHECK(t.output == "kiln-bench: error: --trace-kernels writes one file: give one batch size "
                      "with --batches, got 2\n");
    t = tool("kiln-bench", "--model resnet50 --batches 64 --eager-only" + trace);
    CHECK(t.code == 1);
    CHECK(t.output ==
          "kiln-bench: error: --trace-kernels traces the graph rows; drop --eager-only\n");
    CHECK(!fs::exists(root / "trace.csv"));
  }
  fs::create_directories(root / "corpus" / "train");
  Run r = tool("kiln-loader-bench", "--output-dir " + (root / "corpus").string());
  CHECK(r.code == 1);
  CHECK(r.output == "kiln-loader-bench: error: --output-dir '" + (root / "corpus").string() +
                        "' exists and is not an empty folder (a corpus it holds can be read with "
                        "--folder); the generator writes into an empty or new folder only\n");
  // A corpus of 2 images in 1 class: less than a batch of 8; with a batch of 2, rows, but
  // nowhere to write them.
  const std::string tiny = "--generate 2 --classes 1 --batches 1 --workers 1 --decoder stb ";
  r = tool("kiln-loader-bench", tiny + "-b 8");
  CHECK(r.code == 1);
  CHECK(lines_end_with(r.output,
                       "kiln-loader-bench: error: fewer images than one batch: lower "
                       "--batch-size or add images\n"));
  r = tool("kiln-loader-bench", tiny + "-b 2 --json " + (file / "x.json").string());
  CHECK(r.code == 1);
  // The rows go through write_file_atomic: its temporary file cannot be made under a file.
  const std::string json_tail =
      "' (to be renamed to '" + (file / "x.json").string() + "'): Not a directory\n";
  CHECK(r.output.find("kiln-loader-bench: error: --json: cannot create '" +
                      (file / "x.json").string() + ".tmp.") != std::string::npos);
  CHECK(r.output.size() > json_tail.size());
  CHECK(r.output.compare(r.output.size() - json_tail.size(), json_tail.size(), json_tail) == 0);
  std::error_code ec;
  fs::remove_all(root, ec);
}

TEST_CASE("every tool: a folder or file the user named that cannot be read is one line") {
  const fs::path root =
      fs::temp_directory_path() / ("kiln_test_cli_in_" + std::to_string(::getpid()));
  fs::create_directories(root / "noimg" / "train" / "a");
  fs::create_directories(root / "noimg" / "val" / "a");
  fs::create_directories(root / "idx");
  std::ofstream(root / "idx" / "train-images-idx3-ubyte") << "junk";
  const std::string cpu = " --device cpu --quiet --output " + (root / "out").string();
  Run r = tool("kiln-train", "--data " + (root / "noimg").string() + cpu);
  CHECK(r.code == 1);
  CHECK(r.output ==
        "kiln-train: error: --data: ImageFolder: no image files (.jpg, .jpeg, .png) in "
        "class folder '" +
            (root / "noimg" / "train" / "a").string() + "'\n");
  r = tool("kiln-train", "--data " + (root / "idx").string() + cpu);
  CHECK(r.output == "kiln-train: error: --data: MNIST-style dataset file not found in '" +
                        (root / "idx").string() +
                        "' (tried train-labels-idx1-ubyte.gz, train-labels-idx1-ubyte, "
                        "train-labels.idx1-ubyte.gz, train-labels.idx1-ubyte)\n");
  r = tool("kiln-train",
           "--dummy --dummy-images 64 -b 32 --image-size 16 -a resnet_small "
           "--width 8 --resume " +
               (root / "nope.safetensors").string() + cpu);
  CHECK(r.output == "kiln-train: error: --resume: cannot open safetensors file '" +
                        (root / "nope.safetensors").string() + "': No such file or directory\n");
  r = tool("kiln-loader-bench", "--folder " + (root / "nope").string());
  CHECK(r.code == 1);
  CHECK(r.output == "kiln-loader-bench: error: --folder: ImageFolder: '" +
                        (root / "nope").string() + "' does not exist\n");
  r = tool("kiln-export-images", "--out " + (root / "noimg").string());
  CHECK(r.code == 1);
  CHECK(r.output == "kiln-export-images: error: --out '" + (root / "noimg").string() +
                        "' is not an empty folder (--force writes into a folder)\n");
  r = tool("kiln-export-images",
           "--out " + (root / "new").string() + " --data " + (root / "idx").string());
  CHECK(r.code == 1);
  CHECK(
      r.output.rfind("kiln-export-images: error: --data: MNIST-style dataset file not found in '" +
                         (root / "idx").string() + "'",
                     0) == 0);
  CHECK(cli::without_location(r.output.substr(0, r.output.size() - 1)) ==
        r.output.substr(0, r.output.size() - 1));
  CHECK_FALSE(fs::exists(root / "new"));
  std::error_code ec;
  fs::remove_all(root, ec);
}

TEST_CASE("cli::user_input: a library's error about the user's input, as a UsageError") {
  auto message = [](auto&& fn) {
    try {
      fn();
    } catch (const cli::UsageError& e) {
      return std::string("usage: ") + e.what();
    } catch (const Error& e) {
      return std::string("other: ") + e.what();
    }
    return std::string();
  };
  CHECK(cli::user_input("--x: ", [] { return 7; }) == 7);
  CHECK(message([] { cli::user_input("--x: ", [] { KILN_CHECK(1 == 2, "bad file 'f'"); }); }) ==
        "usage: --x: bad file 'f'");
  CHECK(message([] { cli::user_input("--x: ", [] { cli::usage_error("as is"); }); }) ==
        "usage: as is");
  // A device's failure is not the input's: it keeps its kind and its location.
  const std::string cuda = message([] {
    cli::user_input("--x: ", [] { throw CudaError("cudaMalloc failed [cuda/x.cpp:1]"); });
  });
  CHECK(cuda == "other: cudaMalloc failed [cuda/x.cpp:1]");
}

TEST_CASE("every tool: a bad value is one line naming flag, value and what is allowed; exit 1") {
  struct Case {
    const char* tool;
    const char* args;
    const char* message;
  };
  const Case cases[] = {
      {"kiln-train", "--epochs 0", "kiln-train: error: --epochs '0': expected an integer >= 1"},
      {"kiln-train", "--lr abc", "kiln-train: error: --lr 'abc': expected a number >= 0"},
      {"kiln-bench", "--repeat x", "kiln-bench: error: --repeat 'x': expected an integer >= 1"},
      {"kiln-bench", "--batches 8,0",
       "kiln-bench: error: --batches '8,0': expected comma-separated integers >= 1 (bad item '0')"},
      {"kiln-convert", "--num-classes abc",
       "kiln-convert: error: --num-classes 'abc': expected an integer between 1 and 1000000"},
      {"kiln-export-images", "--split val",
       "kiln-export-images: error: --split 'val': expected one of train, test"},
      {"kiln-loader-bench", "--workers 1,x",
       "kiln-loader-bench: error: --workers '1,x': expected comma-separated integers >= 0 (bad "
       "item 'x')"},
      {"kiln-fusion-probe", "--batch 0",
       "kiln-fusion-probe: error: --batch '0': expected an integer >= 1"},
      {"kiln-gemm-probe", "--reps 0", "kiln-gemm-probe: error: --reps '0': expected an integer >= 1"},
      {"kiln-predict", "--top 0 x.png", "kiln-predict: error: --top '0': expected an integer >= 1"},
  };
  for (const Case& c : cases) {
    INFO(c.tool, " ", c.args);
    const Run r = tool(c.tool, c.args);
    CHECK(r.code == 1);
    CHECK(r.output == std::string(c.message) + "\n");
    const Run u = tool(c.tool, "--no-such-flag");
    CHECK(u.code == 1);
    CHECK(u.output == std::string(c.tool) + ": error: unknown flag '--no-such-flag' (see " +
                          c.tool + " --help)\n");
    const Run h = tool(c.tool, "--help");
    CHECK(h.code == 0);
    CHECK(h.output.rfind(std::string("usage: ") + c.tool, 0) == 0);
  }
}

TEST_CASE("run_tool: output that cannot be written is exit code 1, whatever the body returned") {
  REQUIRE(fs::exists("/dev/full"));
  cli::check_stdout();  // stdout works: no error
  std::fflush(stdout);
  const int saved = ::dup(1);
  const int full = ::open("/dev/full", O_WRONLY | O_CLOEXEC);
  REQUIRE(full >= 0);
  ::dup2(full, 1);
  ::close(full);
  // The body's line sits in stdout's buffer until run_tool flushes it (and prints its own
  // error line on stderr, which the test log shows).
  const int code = cli::run_tool("t", [] {
    std::printf("lost\n");
    return 0;
  });
  std::string what;
  std::printf("lost too\n");
  try {
    cli::check_stdout();
  } catch (const Error& e) {
    what = e.what();
  }
  std::clearerr(stdout);
  ::dup2(saved, 1);
  ::close(saved);
  CHECK(code == 1);
  CHECK(what == "cannot write to standard output: No space left on device");
}

// ---------------- hostile input: environment, control characters, files, folders ----------------

namespace {

std::string bytes_of(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

// Every entry under `dir` (relative name -> bytes, "" for a folder): what "wrote nothing" compares.
std::map<std::string, std::string> tree(const fs::path& dir) {
  std::map<std::string, std::string> t;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    t[fs::relative(e.path(), dir).string()] = e.is_regular_file() ? bytes_of(e.path()) : "";
  return t;
}

// An MNIST-style IDX folder: `n` train and `n` test images of 28x28 (zeros), labels 0..n-1.
void write_idx(const fs::path& dir, int n) {
  auto u32 = [](std::string& b, uint32_t v) {
    for (int s = 24; s >= 0; s -= 8) b.push_back(char(v >> s));
  };
  fs::create_directories(dir);
  for (const char* prefix : {"train", "t10k"}) {
    std::string im, lb;
    u32(im, 0x803);
    u32(im, uint32_t(n));
    u32(im, 28);
    u32(im, 28);
    im.append(size_t(n) * 28 * 28, '\0');
    u32(lb, 0x801);
    u32(lb, uint32_t(n));
    for (int i = 0; i < n; ++i) lb.push_back(char(i % 10));
    std::ofstream(dir / (std::string(prefix) + "-images-idx3-ubyte"), std::ios::binary) << im;
    std::ofstream(dir / (std::string(prefix) + "-labels-idx1-ubyte"), std::ios::binary) << lb;
  }
}

}  // namespace

TEST_CASE("every tool: OMP_NUM_THREADS no machine could start is refused before the body") {
  // libgomp would crash starting them at the first parallel region.
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  const unsigned limit = std::max(256u, 16 * hw);
  const std::string tail = ": more threads than this machine can start (it has " +
                           std::to_string(hw) + " hardware threads); set it to at most " +
                           std::to_string(limit) + ", or unset it\n";
  Run r = tool("kiln-convert", "--in x", "OMP_NUM_THREADS=100000");
  CHECK(r.code == 1);
  CHECK(r.output == "kiln-convert: error: OMP_NUM_THREADS=100000" + tail);
  // The outer level of a nested setting counts; a count the machine can start, or text libgomp
  // ignores, lets the tool go on to its own message.
  r = tool("kiln-convert", "--in x", "OMP_NUM_THREADS=100000,2");
  CHECK(r.output == "kiln-convert: error: OMP_NUM_THREADS=100000,2" + tail);
  // A value libgomp cannot parse makes libgomp itself print "libgomp: Invalid value ..." while the
  // program loads, before kiln runs; kiln's line is the last one either way.
  auto last_line = [](const std::string& s) {
    const size_t cut = s.size() > 1 ? s.rfind('\n', s.size() - 2) : std::string::npos;
    return cut == std::string::npos ? s : s.substr(cut + 1);
  };
  r = tool("kiln-convert", "--in x", "OMP_NUM_THREADS=99999999999999999999999");
  CHECK(last_line(r.output) == "kiln-convert: error: OMP_NUM_THREADS=99999999999999999999999" + tail);
  for (const std::string ok : {std::to_string(limit), std::string("many")}) {
    INFO(ok);
    r = tool("kiln-convert", "--in x", "OMP_NUM_THREADS=" + ok);
    CHECK(r.code == 1);
    CHECK(last_line(r.output) ==
          "kiln-convert: error: nothing to do (give --out and/or --eval-input)\n");
  }
}

TEST_CASE("every tool: a value holding a newline is still one error line, the newline escaped") {
  // The shell's single quotes pass the newline through as part of the value.
  Run r = tool("kiln-train", "--lr 'a\nb'");
  CHECK(r.code == 1);
  CHECK(r.output == "kiln-train: error: --lr 'a\\x0ab': expected a number >= 0\n");
  r = tool("kiln-convert", "--in '/no/such\n/file' --out x.safetensors");
  CHECK(r.code == 1);
  CHECK(std::count(r.output.begin(), r.output.end(), '\n') == 1);
  CHECK(r.output.find("'/no/such\\x0a/file'") != std::string::npos);
}

TEST_CASE("kiln-convert: --in holding a NaN or an infinity is refused, naming the tensor") {
  const fs::path root =
      fs::temp_directory_path() / ("kiln_test_cli_nan_" + std::to_string(::getpid()));
  fs::remove_all(root);
  fs::create_directories(root);
  Tensor bad = ones({4, 3});
  bad.narrow(0, 2, 1).fill_(std::nan(""));
  const fs::path in = root / "nan.safetensors", out = root / "out.safetensors";
  save_safetensors(in.string(), {{"conv1.weight", ones({2, 2})}, {"fc.weight", bad}});
  Run r = tool("kiln-convert", "--in " + in.string() + " --out " + out.string());
  CHECK(r.code == 1);
  CHECK(r.output == "kiln-convert: error: --in '" + in.string() +
                        "': tensor 'fc.weight' holds NaN or infinite values; refusing weights "
                        "that cannot have come from a finished training run\n");
  bad.fill_(-INFINITY);
  save_safetensors(in.string(), {{"fc.bias", bad}});
  r = tool("kiln-convert", "--in " + in.string() + " --out " + out.string());
  CHECK(r.code == 1);
  CHECK(r.output.find("tensor 'fc.bias' holds NaN or infinite values") != std::string::npos);
  CHECK_FALSE(fs::exists(out));
  std::error_code ec;
  fs::remove_all(root, ec);
}

TEST_CASE("kiln-export-images: --out inside --data is refused, even with --force; nothing written") {
  const fs::path root =
      fs::temp_directory_path() / ("kiln_test_cli_export_" + std::to_string(::getpid()));
  fs::remove_all(root);
  const fs::path data = root / "data";
  write_idx(data, 3);
  fs::create_directory_symlink(data, root / "link");
  const auto before = tree(data);
  struct Case {
    fs::path out;
    const char* more;
  };
  for (const Case& c : {Case{data / "out", ""}, Case{data, " --force"},
                        Case{data / "x" / ".." / "y", ""}, Case{root / "link" / "out", " --force"}}) {
    INFO(c.out.string(), c.more);
    const Run r = tool("kiln-export-images",
                       "--out " + c.out.string() + " --data " + data.string() + c.more);
    CHECK(r.code == 1);
    CHECK(r.output == "kiln-export-images: error: --out '" + c.out.string() + "' lies inside --data '" +
                          data.string() + "'; kiln-export-images never writes into the data it reads\n");
    CHECK(tree(data) == before);
  }
  // The same data exported outside it: the refusals above are about where, not what.
  const Run r = tool("kiln-export-images",
                     "--out " + (root / "png").string() + " --data " + data.string());
  CHECK(r.code == 0);
  CHECK(r.output.rfind("wrote 3 PNG files", 0) == 0);
  std::error_code ec;
  fs::remove_all(root, ec);
}

TEST_CASE("kiln-loader-bench: --output-dir holding a user's file is refused and left as it was") {
  const fs::path root =
      fs::temp_directory_path() / ("kiln_test_cli_gen_" + std::to_string(::getpid()));
  fs::remove_all(root);
  const fs::path dir = root / "mine";
  fs::create_directories(dir);
  std::ofstream(dir / "notes.txt") << "the user's notes";
  const std::string gen = "--generate 2 --classes 1 --batches 0 --decoder stb --output-dir ";
  for (const fs::path& target : {dir, dir / "notes.txt"}) {
    INFO(target.string());
    const Run r = tool("kiln-loader-bench", gen + target.string());
    CHECK(r.code == 1);
    CHECK(r.output == "kiln-loader-bench: error: --output-dir '" + target.string() +
                          "' exists and is not an empty folder (a corpus it holds can be read "
                          "with --folder); the generator writes into an empty or new folder only\n");
    CHECK(tree(dir) == std::map<std::string, std::string>{{"notes.txt", "the user's notes"}});
  }
  // A new folder is written (so the refusals above are the folder's doing).
  const Run r = tool("kiln-loader-bench", gen + (root / "new").string());
  CHECK(r.code == 0);
  CHECK(tree(root / "new").size() >= 2);
  std::error_code ec;
  fs::remove_all(root, ec);
}

// ---------------- kiln-speedrun ----------------

TEST_CASE("kiln-speedrun: trains and reports on a small CIFAR-like folder (CPU); bad data in one line") {
  const fs::path root =
      fs::temp_directory_path() / ("kiln_test_cli_speedrun_" + std::to_string(::getpid()));
  fs::remove_all(root);
  // 10 classes of 32x32 RGB PNGs, the class in the colour: 6 to train and 2 to test per class.
  Generator g(4);
  for (const auto& [split, n] : {std::pair<std::string, int>{"train", 6}, {"test", 2}})
    for (int c = 0; c < 10; ++c)
      for (int i = 0; i < n; ++i) {
        data::Image im;
        im.height = im.width = 32;
        im.pixels.resize(32 * 32 * 3);
        for (size_t p = 0; p < im.pixels.size(); ++p)
          im.pixels[p] = uint8_t(25 * c * (p % 3 == 0) + g.below(40));
        const fs::path f = root / split / ("class" + std::to_string(c)) / (std::to_string(i) + ".png");
        fs::create_directories(f.parent_path());
        data::write_png(f.string(), im);
      }
  const fs::path js = root / "runs.json";
  Run r = tool("kiln-speedrun", root.string() + " --device cpu -b 20 --epochs 1 --runs 2 --tta 1 "
                                "--json " + js.string());
  INFO(r.output);
  CHECK(r.code == 0);
  CHECK(r.output.rfind("kiln-speedrun: 60 training and 20 test images (cpu)", 0) == 0);
  CHECK(r.output.find("run 2: test top-1 ") != std::string::npos);
  CHECK(r.output.find("2 runs: accuracy ") != std::string::npos);
  const json::Value v = json::parse(bytes_of(js));
  CHECK(v.at("runs").array().size() == 2);
  CHECK(v.at("accuracy_mean").number() >= 0.0);
  CHECK(v.at("accuracy_mean").number() <= 1.0);
  CHECK(v.at("seconds_mean").number() > 0.0);
  CHECK(v.at("recipe").str() == "legacy");
  // The muon recipe (Muon on the conv filters, no lookahead), its defaults overridden.
  r = tool("kiln-speedrun", root.string() + " --device cpu --recipe muon -b 20 --epochs 2 "
                            "--runs 1 --tta 0 --json " + js.string());
  INFO(r.output);
  CHECK(r.code == 0);
  CHECK(r.output.find("1 runs: accuracy ") != std::string::npos);
  const json::Value m = json::parse(bytes_of(js));
  CHECK(m.at("recipe").str() == "muon");
  CHECK(m.at("batch_size").number() == 20);
  CHECK(m.at("accuracy_mean").number() >= 0.0);
  // Data it cannot train on: one line naming what is wrong.
  r = tool("kiln-speedrun", (root / "nowhere").string() + " --device cpu");
  CHECK(r.code == 1);
  CHECK(std::count(r.output.begin(), r.output.end(), '\n') == 1);
  CHECK(r.output.find("kiln-speedrun: error: DATA: ") == 0);
  fs::remove_all(root / "train" / "class9");
  fs::remove_all(root / "test" / "class9");
  r = tool("kiln-speedrun", root.string() + " --device cpu");
  CHECK(r.code == 1);
  CHECK(r.output == "kiln-speedrun: error: DATA '" + root.string() +
                        "': 9 class folders; the speedrun's network has 10 outputs (CIFAR-10)\n");
  std::error_code ec;
  fs::remove_all(root, ec);
}

TEST_CASE("kiln-train --decoder auto: nvJPEG gets an epoch, then the faster side by more than 1%") {
  using train::auto_decoder_picks_gpu;
  // After the first (CPU) epoch, nvJPEG is tried whatever the CPU's time.
  CHECK(auto_decoder_picks_gpu(0.0285, -1, false, false));
  CHECK(auto_decoder_picks_gpu(0.0100, -1, false, false));
  // The H200 run of 2026-12-03: nvJPEG 31.6 ms per batch against the CPU's 28.5: back to the CPU.
  CHECK_FALSE(auto_decoder_picks_gpu(0.0285, 0.0316, true, false));
  // The side that ran keeps the next epoch unless the other was more than 1% faster.
  CHECK(auto_decoder_picks_gpu(0.0285, 0.0287, true, false));
  CHECK_FALSE(auto_decoder_picks_gpu(0.0285, 0.0283, false, false));
  CHECK(auto_decoder_picks_gpu(0.0285, 0.0280, false, false));
  CHECK_FALSE(auto_decoder_picks_gpu(0.0280, 0.0285, true, false));
  // After a failover, the CPU whatever was measured.
  CHECK_FALSE(auto_decoder_picks_gpu(0.0300, -1, false, true));
  CHECK_FALSE(auto_decoder_picks_gpu(0.0300, 0.0100, true, true));
}
