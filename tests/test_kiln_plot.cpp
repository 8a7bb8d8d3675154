// kiln-plot (tools/kiln-plot, Python + matplotlib) on a run's real logs, and on hostile ones: a
// line it cannot use (not UTF-8, not JSON, no numeric step, a string epoch_frac, 1e308, ...) is
// skipped and counted in one warning per log, the rest is drawn; with nothing left, one error
// line; never a Python traceback. Without matplotlib the suite checks the one line that says so.
#include <doctest/doctest.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "core/json.h"
#include "tests/train_test_util.h"
#include "tools/train/trainer.h"

using namespace kiln;
using namespace std::string_literals;
namespace fs = std::filesystem;

namespace {

using testutil::image_folder;
using testutil::tmp;

// resnet_small of width 8 on 16x16 crops, batch 32: 9 steps per epoch.
std::vector<std::string> job(const fs::path& out, int64_t epochs,
                             const std::vector<std::string>& more = {}) {
  std::vector<std::string> a = {image_folder(),
                                "-a",
                                "resnet_small",
                                "--width",
                                "8",
                                "--image-size",
                                "16",
                                "-b",
                                "32",
                                "--epochs",
                                std::to_string(epochs),
                                "-j",
                                "1",
                                "--device",
                                "cpu",
                                "--output",
                                out.string(),
                                "--quiet"};
  a.insert(a.end(), more.begin(), more.end());
  return a;
}

std::vector<json::Value> read_jsonl(const fs::path& p) {
  std::ifstream f(p);
  std::vector<json::Value> lines;
  for (std::string line; std::getline(f, line);) lines.push_back(json::parse(line));
  return lines;
}

struct Run {
  int code = -1;
  std::string output;
};

Run run_command(const std::string& cmd) {
  Run r;
  std::FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  REQUIRE(p != nullptr);
  std::array<char, 4096> buf;
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  const int status = ::pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// "python3 .../tools/kiln-plot", with Debian's python3 (where python3-matplotlib installs) when
// present.
std::string plot_command() {
  const char* source = std::getenv("KILN_SOURCE_DIR");
  const fs::path script =
      fs::path(source ? source : fs::read_symlink("/proc/self/exe").parent_path().parent_path()) /
      "tools" / "kiln-plot";
  REQUIRE(fs::exists(script));
  const std::string python = fs::exists("/usr/bin/python3") ? "/usr/bin/python3" : "python3";
  return python + " " + script.string();
}

// Whether that python has matplotlib; without it kiln-plot must say so in one line.
bool have_matplotlib() {
  static const bool have = [] {
    const fs::path dir = tmp().dir / "plot_probe";
    fs::create_directories(dir);
    std::ofstream(dir / "steps.jsonl") << "{\"step\": 1, \"loss\": 1.0}\n";
    const Run r = run_command(plot_command() + " " + dir.string());
    if (r.code == 0) return true;
    CHECK(r.output ==
          "kiln-plot: error: matplotlib is not installed (Debian: apt-get install "
          "python3-matplotlib; pip: pip install matplotlib)\n");
    MESSAGE("SKIPPED: no matplotlib for " << plot_command());
    return false;
  }();
  return have;
}

bool is_png(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  char sig[8] = {};
  f.read(sig, 8);
  return f.gcount() == 8 && std::memcmp(sig, "\x89PNG\r\n\x1a\n", 8) == 0;
}

std::vector<std::string> lines_of(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

bool has_line(const std::string& output, const std::string& line) {
  for (const std::string& l : lines_of(output))
    if (l == line) return true;
  return false;
}

// A step line as kiln-train writes it, for step `s` of 8 per epoch.
std::string step_line(int s) {
  return "{\"step\": " + std::to_string(s) +
         ", \"epoch\": 1, \"epoch_frac\": " + std::to_string(s / 8.0) +
         ", \"loss\": " + std::to_string(2.0 / s) +
         ", \"top1\": 0.5, \"lr\": 0.1, \"loss_scale\": 1, \"images_per_s\": 100, "
         "\"ms_compute\": 5, \"ms_data\": 1}\n";
}

// A fresh folder holding `steps` as steps.jsonl and `log` as log.jsonl (none when empty).
fs::path logs(const std::string& name, const std::string& steps, const std::string& log = "") {
  const fs::path d = tmp().dir / "plot" / name;
  fs::remove_all(d);
  fs::create_directories(d);
  if (!steps.empty()) std::ofstream(d / "steps.jsonl", std::ios::binary) << steps;
  if (!log.empty()) std::ofstream(d / "log.jsonl", std::ios::binary) << log;
  return d;
}

}  // namespace

TEST_CASE("kiln-plot: draws a run's logs; an empty folder is one clear line") {
  const char* source = std::getenv("KILN_SOURCE_DIR");
  const fs::path script =
      fs::path(source ? source : fs::read_symlink("/proc/self/exe").parent_path().parent_path()) /
      "tools" / "kiln-plot";
  REQUIRE(fs::exists(script));
  // Debian's python3 (where python3-matplotlib installs) when present.
  const std::string python = fs::exists("/usr/bin/python3") ? "/usr/bin/python3" : "python3";
  const fs::path out = tmp().dir / "plot_run";
  train::run(train::parse_args(job(out, 1)));
  const fs::path png = tmp().dir / "curves.png";
  Run r = run_command(python + " " + script.string() + " " + out.string() + " -o " + png.string());
  if (r.code == 0) {
    std::ifstream f(png, std::ios::binary);
    char sig[8] = {};
    f.read(sig, 8);
    CHECK(std::memcmp(sig, "\x89PNG\r\n\x1a\n", 8) == 0);
    CHECK(r.output.find("wrote " + png.string()) != std::string::npos);
  } else {
    CHECK(r.output.find("kiln-plot: error: matplotlib is not installed") != std::string::npos);
  }
  const fs::path empty = tmp().dir / "no_logs";
  fs::create_directories(empty);
  r = run_command(python + " " + script.string() + " " + empty.string());
  CHECK(r.code == 1);
  CHECK(r.output == "kiln-plot: error: '" + empty.string() +
                        "' holds no training logs (steps.jsonl, log.jsonl are missing or empty)\n");
  CHECK_FALSE(fs::exists(empty / "curves.png"));
  r = run_command(python + " " + script.string() + " " + out.string() + " -o " +
                  (out / "log.jsonl").string());
  CHECK(r.code == 1);
  CHECK(read_jsonl(out / "log.jsonl").size() == 1);  // nothing overwritten
}

TEST_CASE("kiln-plot: each kind of unusable line is skipped, counted and named; the rest drawn") {
  if (!have_matplotlib()) return;
  struct Case {
    const char* name;
    std::string line;
    const char* reason;
  };
  const Case cases[] = {
      {"byte_ff", "{\"step\": 4, \"loss\": 1.0\xff}\n", "not UTF-8"},
      {"latin1", "{\"step\": 4, \"note\": \"caf\xe9\"}\n", "not UTF-8"},
      {"torn", "{\"step\": 4, \"loss\": 0.\n", "not JSON"},
      {"nul", "{\"step\": 4,\0 \"loss\": 1}\n"s, "not JSON"},
      {"deep", std::string(100000, '[') + "\n", "not JSON"},
      {"array", "[4, 1.0]\n", "not a JSON object"},
      {"no_step", "{\"epoch\": 1, \"loss\": 1.0}\n", "without a numeric step"},
      {"null_step", "{\"step\": null, \"loss\": 1.0}\n", "without a numeric step"},
      {"string_step", "{\"step\": \"4\", \"loss\": 1.0}\n", "without a numeric step"},
      {"bool_step", "{\"step\": true, \"loss\": 1.0}\n", "without a numeric step"},
      {"huge_step", "{\"step\": 1e308, \"loss\": 1.0}\n", "with step out of range"},
      {"inf_step", "{\"step\": 1e999, \"loss\": 1.0}\n", "with step out of range"},
      {"long_int_step", "{\"step\": " + std::string(400, '9') + "}\n", "with step out of range"},
      {"string_frac", "{\"step\": 4, \"epoch_frac\": \"0.5\"}\n", "with a non-numeric epoch_frac"},
      {"huge_loss", "{\"step\": 4, \"loss\": 1e308}\n", "with loss out of range"},
      {"neg_huge_lr", "{\"step\": 4, \"lr\": -1e301}\n", "with lr out of range"},
      {"nan_loss", "{\"step\": 4, \"loss\": NaN}\n", "with loss out of range"},
      {"bool_top1", "{\"step\": 4, \"top1\": false}\n", "with a non-numeric top1"},
      {"list_loss", "{\"step\": 4, \"loss\": [1]}\n", "with a non-numeric loss"},
  };
  // One run (matplotlib takes a while to start): three good lines, then each case's line
  // followed by a good one. The warning counts every reason, in the order first met.
  std::string steps = step_line(1) + step_line(2) + step_line(3);
  std::vector<std::pair<std::string, int>> reasons;
  int good = 3, bad = 0;
  for (const Case& c : cases) {
    steps += c.line + step_line(++good);
    ++bad;
    auto it = std::find_if(reasons.begin(), reasons.end(),
                           [&](const auto& r) { return r.first == c.reason; });
    if (it == reasons.end())
      reasons.emplace_back(c.reason, 1);
    else
      ++it->second;
  }
  std::string summary;
  for (const auto& [reason, count] : reasons)
    summary += (summary.empty() ? "" : ", ") + std::to_string(count) + " " + reason;
  const fs::path d = logs("kinds", steps);
  const Run r = run_command(plot_command() + " " + d.string());
  INFO(r.output);
  CHECK(r.code == 0);
  CHECK(is_png(d / "curves.png"));
  CHECK(has_line(r.output, "kiln-plot: warning: " + (d / "steps.jsonl").string() + ": skipped " +
                               std::to_string(bad) + " of " + std::to_string(good + bad) +
                               " lines (" + summary + "; first at line 4)"));
  CHECK(has_line(r.output, "kiln-plot: wrote " + (d / "curves.png").string() + " (" +
                               std::to_string(good) + " steps, 0 epochs)"));
  CHECK(lines_of(r.output).size() == 2);
  CHECK(r.output.find("Traceback") == std::string::npos);
}

TEST_CASE("kiln-plot: a real run's logs with hostile lines mixed in; null fields are gaps") {
  if (!have_matplotlib()) return;
  const fs::path run = tmp().dir / "plot_hostile_run";
  train::run(train::parse_args(job(run, 2)));
  const size_t n_steps = read_jsonl(run / "steps.jsonl").size();
  REQUIRE(n_steps == 18);
  // The four of the issue, a blank line (ignored), a null loss (kiln-train's non-finite metric:
  // drawn as a gap, not skipped), a last line torn by a crash, and in log.jsonl a byte-order mark
  // and a string epoch.
  {
    std::ofstream s(run / "steps.jsonl", std::ios::app | std::ios::binary);
    s << "{\"step\": 19, \"loss\": 1.0, \"bad\": \"\xff\xfe\"}\n"
      << "{\"loss\": 0.5, \"lr\": 0.1}\n"
      << "\n"
      << "{\"step\": \"20\", \"epoch_frac\": 2.1}\n"
      << "{\"step\": 21, \"epoch_frac\": \"2.2\"}\n"
      << "{\"step\": 22, \"loss\": 1e308, \"images_per_s\": 1e308}\n"
      << "{\"step\": 23, \"epoch\": 3, \"epoch_frac\": 2.5, \"loss\": null, \"top1\": null}\n"
      << "{\"step\": 24, \"lo";  // torn by a crash: no newline
  }
  const std::string log = [&] {
    std::ifstream f(run / "log.jsonl", std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
  }();
  std::ofstream(run / "log.jsonl", std::ios::binary)
      << "\xef\xbb\xbf" << log << "{\"epoch\": \"3\", \"test_top1\": 0.9}\n";
  const fs::path png = tmp().dir / "hostile.png";
  const Run r = run_command(plot_command() + " " + run.string() + " -o " + png.string());
  INFO(r.output);
  CHECK(r.code == 0);
  CHECK(is_png(png));
  CHECK(has_line(r.output, "kiln-plot: warning: " + (run / "steps.jsonl").string() +
                               ": skipped 6 of 25 lines (1 not UTF-8, 2 without a numeric step, 1 "
                               "with a non-numeric epoch_frac, 1 with loss out of range, 1 not "
                               "JSON; first at line 19)"));
  CHECK(has_line(r.output, "kiln-plot: warning: " + (run / "log.jsonl").string() +
                               ": skipped 1 of 3 lines (1 without a numeric epoch; first at line "
                               "3)"));
  CHECK(has_line(r.output, "kiln-plot: wrote " + png.string() + " (19 steps, 2 epochs)"));
  CHECK(lines_of(r.output).size() == 3);
  CHECK(r.output.find("Traceback") == std::string::npos);
}

TEST_CASE("kiln-plot: nothing drawable is one error line after the warnings, and no image") {
  if (!have_matplotlib()) return;
  const fs::path d = logs("nothing", "\xff\n{\"loss\": 1}\n", "{\"epoch\": \"one\"}\n");
  const Run r = run_command(plot_command() + " " + d.string());
  CHECK(r.code == 1);
  CHECK(r.output ==
        "kiln-plot: warning: " + (d / "steps.jsonl").string() +
            ": skipped 2 of 2 lines (1 not UTF-8, 1 without a numeric step; first at line 1)\n"
            "kiln-plot: warning: " +
            (d / "log.jsonl").string() +
            ": skipped 1 of 1 lines (1 without a numeric epoch; first at line 1)\n"
            "kiln-plot: error: '" +
            d.string() +
            "': no line of steps.jsonl or log.jsonl can be drawn (the warnings "
            "above say why)\n");
  CHECK_FALSE(fs::exists(d / "curves.png"));
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(d)) files += e.is_regular_file();
  CHECK(files == 2);  // no temporary image left behind

  // Blank lines only: no training logs at all.
  const fs::path blank = logs("blank", "\n\n  \n");
  const Run b = run_command(plot_command() + " " + blank.string());
  CHECK(b.code == 1);
  CHECK(b.output == "kiln-plot: error: '" + blank.string() +
                        "' holds no training logs (steps.jsonl, log.jsonl are missing or empty)\n");
}

TEST_CASE("kiln-plot: one log alone, epochs only, values at the edge of the range") {
  if (!have_matplotlib()) return;
  // log.jsonl alone: per-epoch points against the epoch.
  fs::path d = logs("epochs_only", "",
                    "{\"epoch\": 1, \"train_loss\": 2.0, \"test_top1\": 0.5, \"lr\": 0.1}\n"
                    "{\"epoch\": 2, \"train_loss\": 1.0, \"test_top1\": null, \"lr\": 0.01}\n");
  Run r = run_command(plot_command() + " " + d.string());
  CHECK(r.code == 0);
  CHECK(r.output == "kiln-plot: wrote " + (d / "curves.png").string() + " (0 steps, 2 epochs)\n");
  CHECK(is_png(d / "curves.png"));
  // +-1e300 is still drawn (scaled by 100 for percentages, summed by the moving average); steps
  // per epoch beyond the range (1e300 / 1e-300) leave the epoch axis out.
  std::string steps;
  for (int s = 1; s <= 60; ++s)
    steps += "{\"step\": " + std::string(s % 2 ? "1e300" : std::to_string(s)) +
             ", \"epoch_frac\": " + (s == 59 ? "1e-300" : std::to_string(s / 60.0)) +
             ", \"loss\": 1e300, \"top1\": -1e300, \"lr\": 1e300, \"images_per_s\": 1e300, "
             "\"ms_compute\": 1e300, \"ms_data\": 1e300}\n";
  d = logs("edge", steps, "{\"epoch\": -1e300, \"train_loss\": 1e300, \"test_top1\": 1e300}\n");
  r = run_command(plot_command() + " " + d.string() + " --smooth 30");
  CHECK(r.code == 0);
  CHECK(r.output == "kiln-plot: wrote " + (d / "curves.png").string() + " (60 steps, 1 epochs)\n");
  CHECK(is_png(d / "curves.png"));
}

TEST_CASE("kiln-plot: an unexpected failure is one line, not a traceback") {
  if (!have_matplotlib()) return;
  // A matplotlib that raises on import stands in for any defect kiln-plot did not foresee.
  const fs::path fake = tmp().dir / "plot_fake_matplotlib" / "matplotlib";
  fs::create_directories(fake);
  std::ofstream(fake / "__init__.py") << "raise RuntimeError('broken install')\n";
  const fs::path d = logs("unexpected", step_line(1));
  const Run r = run_command("PYTHONPATH=" + fake.parent_path().string() + " " + plot_command() +
                            " " + d.string());
  CHECK(r.code == 1);
  CHECK(r.output == "kiln-plot: error: unexpected RuntimeError: broken install\n");
  CHECK_FALSE(fs::exists(d / "curves.png"));
}

TEST_CASE("kiln-plot: a FIFO, a bad argument, an -o that is not a file: one line, no hang") {
  // `timeout`: a regression that waits on the FIFO ends with 124 instead of hanging ctest.
  const std::string plot = "timeout -k 5 60 " + plot_command();
  // A log.jsonl that is a FIFO without a writer: reading it would never end. Refused before
  // matplotlib is needed.
  const fs::path d = logs("fifo", step_line(1) + step_line(2));
  REQUIRE(::mkfifo((d / "log.jsonl").c_str(), 0600) == 0);
  Run r = run_command(plot + " " + d.string());
  CHECK(r.code == 1);
  CHECK(r.output == "kiln-plot: error: cannot read '" + (d / "log.jsonl").string() +
                        "': it is not a regular file (a FIFO or device)\n");
  CHECK(fs::is_fifo(fs::symlink_status(d / "log.jsonl")));
  CHECK_FALSE(fs::exists(d / "curves.png"));

  // A value argparse cannot read, and no OUTPUT_DIR: kiln's one line, exit 2, no usage block.
  for (const std::string& args : {" --smooth abc " + d.string(), std::string()}) {
    INFO(args);
    r = run_command(plot + args);
    CHECK(r.code == 2);
    CHECK(r.output.rfind("kiln-plot: error: ", 0) == 0);
    CHECK(lines_of(r.output).size() == 1);
    CHECK(r.output.find("(see kiln-plot --help)\n") != std::string::npos);
  }
  CHECK(run_command(plot + " --smooth abc " + d.string()).output.find("'abc'") !=
        std::string::npos);

  // -o naming a folder: refused, the folder as it was.
  const fs::path good = logs("o_not_a_file", step_line(1) + step_line(2));
  const fs::path folder = good / "folder.png";
  fs::create_directories(folder);
  r = run_command(plot + " " + good.string() + " -o " + folder.string());
  CHECK(r.code == 1);
  CHECK(r.output == "kiln-plot: error: -o '" + folder.string() + "' is a folder\n");
  CHECK(fs::is_directory(folder));
  CHECK(fs::is_empty(folder));
  if (!have_matplotlib()) return;
  // -o naming a FIFO: refused (after drawing), never replaced; no temporary image left.
  const fs::path fifo = good / "fifo.png";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  r = run_command(plot + " " + good.string() + " -o " + fifo.string());
  CHECK(r.code == 1);
  CHECK(r.output == "kiln-plot: error: cannot write '" + fifo.string() +
                        "': it exists and is not a regular file (a folder, FIFO or device); "
                        "choose another -o\n");
  CHECK(fs::is_fifo(fs::symlink_status(fifo)));
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(good)) files += e.is_regular_file();
  CHECK(files == 1);  // steps.jsonl alone
}
