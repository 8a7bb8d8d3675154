#pragma once
// The command-line parser every kiln tool uses (kiln-train, kiln-bench, kiln-convert,
// kiln-predict, kiln-export-images, kiln-loader-bench, kiln-fusion-probe), so they all spell
// flags and report mistakes the same way.
//
//   cli::Parser p("kiln-convert", "--arch NAME --in A.safetensors [flags]", "Moves weights ...");
//   p.value("--arch", "NAME", &arch, "model name");
//   p.value("--num-classes", "N", &classes, "classifier width", 1);   // integer >= 1
//   p.choice("--split", &split, {"train", "test"}, "which split");
//   p.flag("--force", &force, "overwrite");
//   if (!p.parse(argc, argv)) { std::fputs(p.info().c_str(), stdout); return 0; }  // --help
//
// Syntax (argparse's): "--name value", "--name=value", "-x value", "-xVALUE" for one-letter
// flags that take a value, "--" ends the flags; a flag given twice keeps its last value.
// Positional arguments are collected where the tool declares them.
//
// Why our own and not CLI11 (Debian's libcli11-dev): the GPU machine has no CLI11 and installs
// nothing, so it would have to travel in .deps; what kiln needs (typed values with ranges, one
// message shape, argparse's spellings) is this file and its .cpp.
//
// Every mistake throws UsageError with one line that names the flag, the value and what is
// allowed, and no source location ("--num-classes 'abc': expected an integer >= 1"); tools
// print it as "<tool>: error: <message>" (run_tool). Internal failures stay kiln::Errors with
// their file:line.
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "core/error.h"

namespace kiln::cli {

// A mistake in what the user asked for (a flag, a value, a missing file they named): the
// message is complete without a source location.
class UsageError : public Error {
 public:
  using Error::Error;
};

template <typename... Args>
[[noreturn]] void usage_error(const Args&... args) {
  throw UsageError(detail::str_cat(args...));
}

// `what` without the " [file.cpp:12, check failed: ...]" parts kiln::Error adds (core/error.h's
// strip_location): for passing on a library's message about the user's own input (a file they
// named) inside a UsageError.
std::string without_location(const std::string& what);

// Returns fn(); a plain kiln::Error it throws becomes a UsageError "<prefix><its message without
// the location>". For a library call that reads what the user named (a --data folder, a --resume
// file), whose failures are the user's to fix. UsageErrors pass unchanged; CUDA, cuDNN, cuBLAS
// and out-of-memory errors too (they are not about the input).
//   const data::ImageFolder f = cli::user_input("--folder: ", [&] { return data::ImageFolder(d);
//   });
template <typename Fn>
auto user_input(const std::string& prefix, Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const UsageError&) {
    throw;
  } catch (const CudaError&) {
    throw;
  } catch (const CudnnError&) {
    throw;
  } catch (const CublasError&) {
    throw;
  } catch (const OutOfMemoryError&) {
    throw;
  } catch (const Error& e) {
    usage_error(prefix, without_location(e.what()));
  }
}

// Whether an upper bound is allowed itself (label smoothing < 1) or not.
enum class Upper { Closed, Open };

class Parser {
 public:
  // synopsis: what follows the program name in the usage line; description: a paragraph.
  Parser(std::string program, std::string synopsis, std::string description);

  // `names`: comma-separated spellings, e.g. "-b, --batch-size" or "--lr, --learning-rate".
  // --help appends "(default X)" from the target's value at registration, unless the value is
  // an empty string or the help text already says "default".
  void flag(const std::string& names, bool* out, const std::string& help);
  void value(const std::string& names, const std::string& metavar, std::string* out,
             const std::string& help);
  void value(const std::string& names, const std::string& metavar, int64_t* out,
             const std::string& help, int64_t lo = std::numeric_limits<int64_t>::min(),
             int64_t hi = std::numeric_limits<int64_t>::max());
  void value(const std::string& names, const std::string& metavar, int* out,
             const std::string& help, int lo = std::numeric_limits<int>::min(),
             int hi = std::numeric_limits<int>::max());
  void value(const std::string& names, const std::string& metavar, uint64_t* out,
             const std::string& help);
  void value(const std::string& names, const std::string& metavar, double* out,
             const std::string& help, double lo = -std::numeric_limits<double>::infinity(),
             double hi = std::numeric_limits<double>::infinity(), Upper upper = Upper::Closed);
  void choice(const std::string& names, std::string* out, const std::vector<std::string>& choices,
              const std::string& help);
  // Comma-separated integers, each >= lo ("32,64,128").
  void list(const std::string& names, const std::string& metavar, std::vector<int64_t>* out,
            const std::string& help, int64_t lo);
  // Positional arguments, in order, into *out; between min_count and max_count of them.
  void positional(const std::string& metavar, std::vector<std::string>* out,
                  const std::string& help, size_t min_count = 0,
                  size_t max_count = std::numeric_limits<size_t>::max());
  // A heading in --help between groups of flags.
  void section(const std::string& title);

  // Adds --version, which makes parse() return false with info() = `line`.
  void version(std::string line);

  // Parses; false when -h/--help or --version was among the arguments (the rest is still
  // checked): the tool prints info() and exits 0. Throws UsageError.
  bool parse(const std::vector<std::string>& args);
  bool parse(int argc, char** argv);
  // After parse() returned false: the help text, or the version line when --version was asked.
  std::string info() const;

  // Whether any spelling of the flag (one name of it, e.g. "--lr") was on the command line.
  bool given(const std::string& name) const;

  std::string help() const;
  const std::string& program() const { return program_; }

 private:
  struct Option {
    std::vector<std::string> names;
    std::string metavar;  // empty: a switch
    std::string help;
    std::string default_text;
    std::function<void(const std::string& flag, const std::string& value)> set;
    bool seen = false;
  };
  struct HelpLine {
    int option = -1;  // index into options_, or -1 for a section title
    std::string title;
  };
  Option& add(const std::string& names, const std::string& metavar, const std::string& help,
              std::string default_text);
  Option* find(const std::string& name);

  std::string program_, synopsis_, description_;
  std::vector<Option> options_;
  std::vector<HelpLine> layout_;
  std::string version_line_;
  bool version_asked_ = false;
  std::string pos_metavar_, pos_help_;
  std::vector<std::string>* pos_out_ = nullptr;
  size_t pos_min_ = 0, pos_max_ = 0;
};

// Flushes stdout; throws kiln::Error "cannot write to standard output: <reason>" (no source
// location) when that or an earlier write to it failed (a full disk, a closed descriptor, a
// closed pipe when SIGPIPE is ignored; by default SIGPIPE ends the process, as for cat).
void check_stdout();

// Runs a tool's body, then check_stdout(): returns the body's exit code, or prints
// "<program>: error: <what>" on stderr, on one line (text::printable: a newline a value held is
// shown as \n), and returns 1 for any exception (so output that was lost is never an exit code
// 0). Before the body, an OMP_NUM_THREADS larger than the machine could start (libgomp crashes
// on it at the first parallel region) is refused.
int run_tool(const std::string& program, const std::function<int()>& body);

}  // namespace kiln::cli
