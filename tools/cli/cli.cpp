#include "tools/cli/cli.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <thread>
#include <type_traits>

#include "core/text.h"

namespace kiln::cli {

namespace {

std::vector<std::string> split_names(const std::string& names) {
  std::vector<std::string> out;
  std::stringstream ss(names);
  for (std::string n; std::getline(ss, n, ',');) {
    const size_t b = n.find_first_not_of(' '), e = n.find_last_not_of(' ');
    if (b != std::string::npos) out.push_back(n.substr(b, e - b + 1));
  }
  return out;
}

std::string fmt_number(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// "an integer >= 1", "an integer between 0 and 65535", "an integer".
template <typename T>
std::string int_range(T lo, T hi) {
  const bool has_lo = std::is_unsigned_v<T> || lo != std::numeric_limits<T>::min();
  const bool has_hi = hi != std::numeric_limits<T>::max();
  if (has_lo && has_hi)
    return "an integer between " + std::to_string(lo) + " and " + std::to_string(hi);
  if (has_lo) return "an integer >= " + std::to_string(lo);
  if (has_hi) return "an integer <= " + std::to_string(hi);
  return "an integer";
}

template <typename T>
T parse_int(const std::string& flag, const std::string& v, T lo, T hi) {
  T x{};
  const char* end = v.data() + v.size();
  const auto r = std::from_chars(v.data() + (!v.empty() && v[0] == '+'), end, x);
  if (v.empty() || r.ec != std::errc() || r.ptr != end || x < lo || x > hi)
    usage_error(flag, " '", v, "': expected ", int_range(lo, hi));
  return x;
}

}  // namespace

Parser::Parser(std::string program, std::string synopsis, std::string description)
    : program_(std::move(program)),
      synopsis_(std::move(synopsis)),
      description_(std::move(description)) {}

Parser::Option& Parser::add(const std::string& names, const std::string& metavar,
                            const std::string& help, std::string default_text) {
  Option o;
  o.names = split_names(names);
  KILN_CHECK(!o.names.empty(), "cli: option without a name");
  for (const std::string& n : o.names)
    KILN_CHECK(n.size() >= 2 && n[0] == '-' && find(n) == nullptr, "cli: bad or repeated name ", n);
  o.metavar = metavar;
  o.help = help;
  if (help.find("default") == std::string::npos) o.default_text = std::move(default_text);
  layout_.push_back({int(options_.size()), ""});
  options_.push_back(std::move(o));
  return options_.back();
}

Parser::Option* Parser::find(const std::string& name) {
  for (Option& o : options_)
    for (const std::string& n : o.names)
      if (n == name) return &o;
  return nullptr;
}

void Parser::flag(const std::string& names, bool* out, const std::string& help) {
  add(names, "", help, "").set = [out](const std::string&, const std::string&) { *out = true; };
}

void Parser::value(const std::string& names, const std::string& metavar, std::string* out,
                   const std::string& help) {
  add(names, metavar, help, *out).set = [out](const std::string& flag, const std::string& v) {
    if (v.empty()) usage_error(flag, " '': expected a non-empty value");
    *out = v;
  };
}

void Parser::value(const std::string& names, const std::string& metavar, int64_t* out,
                   const std::string& help, int64_t lo, int64_t hi) {
  add(names, metavar, help, std::to_string(*out)).set =
      [=](const std::string& flag, const std::string& v) { *out = parse_int(flag, v, lo, hi); };
}

void Parser::value(const std::string& names, const std::string& metavar, int* out,
                   const std::string& help, int lo, int hi) {
  add(names, metavar, help, std::to_string(*out)).set =
      [=](const std::string& flag, const std::string& v) { *out = parse_int(flag, v, lo, hi); };
}

void Parser::value(const std::string& names, const std::string& metavar, uint64_t* out,
                   const std::string& help) {
  add(names, metavar, help, std::to_string(*out)).set = [=](const std::string& flag,
                                                            const std::string& v) {
    *out = parse_int(flag, v, uint64_t(0), std::numeric_limits<uint64_t>::max());
  };
}

void Parser::value(const std::string& names, const std::string& metavar, double* out,
                   const std::string& help, double lo, double hi, Upper upper) {
  add(names, metavar, help, fmt_number(*out)).set = [=](const std::string& flag,
                                                        const std::string& v) {
    char* end = nullptr;
    errno = 0;
    const double x = v.empty() ? NAN : std::strtod(v.c_str(), &end);
    const bool hi_ok = upper == Upper::Open ? x < hi : x <= hi;
    if (v.empty() || *end != '\0' || !std::isfinite(x) || !(x >= lo) || !hi_ok) {
      std::string allowed = "a number";
      const std::string hi_op = upper == Upper::Open ? " and < " : " and <= ";
      if (std::isfinite(lo) && std::isfinite(hi))
        allowed += " >= " + fmt_number(lo) + hi_op + fmt_number(hi);
      else if (std::isfinite(lo))
        allowed += " >= " + fmt_number(lo);
      else if (std::isfinite(hi))
        allowed += (upper == Upper::Open ? " < " : " <= ") + fmt_number(hi);
      usage_error(flag, " '", v, "': expected ", allowed);
    }
    *out = x;
  };
}

void Parser::choice(const std::string& names, std::string* out,
                    const std::vector<std::string>& choices, const std::string& help) {
  std::string list, metavar;
  for (const std::string& c : choices) {
    list += (list.empty() ? "" : ", ") + c;
    metavar += (metavar.empty() ? "" : "|") + c;
  }
  add(names, metavar, help, *out).set = [=](const std::string& flag, const std::string& v) {
    for (const std::string& c : choices)
      if (v == c) {
        *out = v;
        return;
      }
    usage_error(flag, " '", v, "': expected one of ", list);
  };
}

void Parser::list(const std::string& names, const std::string& metavar, std::vector<int64_t>* out,
                  const std::string& help, int64_t lo) {
  std::string def;
  for (int64_t x : *out) {
    if (!def.empty()) def += ',';
    def += std::to_string(x);
  }
  add(names, metavar, help, def).set = [=](const std::string& flag, const std::string& v) {
    std::vector<int64_t> items;
    size_t pos = 0;
    while (true) {
      const size_t comma = v.find(',', pos);
      const std::string item = v.substr(pos, comma == std::string::npos ? comma : comma - pos);
      int64_t x{};
      const auto r = std::from_chars(item.data(), item.data() + item.size(), x);
      if (item.empty() || r.ec != std::errc() || r.ptr != item.data() + item.size() || x < lo)
        usage_error(flag, " '", v, "': expected comma-separated integers >= ", lo, " (bad item '",
                    item, "')");
      items.push_back(x);
      if (comma == std::string::npos) break;
      pos = comma + 1;
    }
    *out = std::move(items);
  };
}

void Parser::positional(const std::string& metavar, std::vector<std::string>* out,
                        const std::string& help, size_t min_count, size_t max_count) {
  pos_metavar_ = metavar;
  pos_help_ = help;
  pos_out_ = out;
  pos_min_ = min_count;
  pos_max_ = max_count;
}

void Parser::version(std::string line) {
  version_line_ = std::move(line);
  flag("--version", &version_asked_, "the version and build, then exit");
}

std::string Parser::info() const { return version_asked_ ? version_line_ + "\n" : help(); }

void Parser::section(const std::string& title) { layout_.push_back({-1, title}); }

bool Parser::given(const std::string& name) const {
  for (const Option& o : options_)
    for (const std::string& n : o.names)
      if (n == name) return o.seen;
  KILN_FAIL("cli: given(", name, "): no such flag");
}

bool Parser::parse(int argc, char** argv) {
  return parse(std::vector<std::string>(argv + 1, argv + argc));
}

bool Parser::parse(const std::vector<std::string>& args) {
  bool help = false, flags_done = false;
  std::vector<std::string> positionals;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (flags_done || a.size() < 2 || a[0] != '-' ||
        (a.size() > 1 && (std::isdigit(static_cast<unsigned char>(a[1])) || a[1] == '.'))) {
      positionals.push_back(a);
      continue;
    }
    if (a == "--") {
      flags_done = true;
      continue;
    }
    if (a == "-h" || a == "--help") {
      help = true;
      continue;
    }
    std::string name = a, inline_value;
    bool has_inline = false;
    if (a.rfind("--", 0) == 0) {
      const size_t eq = a.find('=');
      if (eq != std::string::npos) {
        name = a.substr(0, eq);
        inline_value = a.substr(eq + 1);
        has_inline = true;
      }
    } else if (a.size() > 2) {  // "-j4": a one-letter flag with its value attached
      name = a.substr(0, 2);
      inline_value = a.substr(a[2] == '=' ? 3 : 2);
      has_inline = true;
    }
    Option* o = find(name);
    if (o == nullptr) usage_error("unknown flag '", name, "' (see ", program_, " --help)");
    o->seen = true;
    if (o->metavar.empty()) {
      if (has_inline) usage_error("flag ", name, " takes no value, got '", inline_value, "'");
      o->set(name, "");
      continue;
    }
    if (!has_inline) {
      if (i + 1 >= args.size()) usage_error("flag ", name, " needs a value (", o->metavar, ")");
      inline_value = args[++i];
    }
    o->set(name, inline_value);
  }
  if (pos_out_ == nullptr && !positionals.empty())
    usage_error("unexpected argument '", positionals[0], "' (", program_,
                " takes only flags; see --help)");
  help = help || version_asked_;
  if (pos_out_ != nullptr && !help) {
    if (positionals.size() > pos_max_)
      usage_error("unexpected argument '", positionals[pos_max_], "' (", program_, " takes ",
                  pos_max_ == 1 ? "one " : "at most " + std::to_string(pos_max_) + " ",
                  pos_metavar_, ")");
    if (positionals.size() < pos_min_)
      usage_error("missing ", pos_metavar_, " (usage: ", program_, " ", synopsis_, ")");
  }
  if (pos_out_ != nullptr) *pos_out_ = std::move(positionals);
  return !help;
}

std::string Parser::help() const {
  std::string s = "usage: " + program_ + " " + synopsis_ + "\n";
  if (!description_.empty()) s += description_ + "\n";
  auto row = [&](std::string left, const std::string& text) {
    left = "  " + left;
    // Continuation lines of a long text keep the column.
    std::string body;
    for (char ch : text)
      body += ch == '\n' ? std::string("\n") + std::string(26, ' ') : std::string(1, ch);
    if (left.size() < 25)
      s += left + std::string(26 - left.size(), ' ') + body + "\n";
    else
      s += left + "\n" + std::string(26, ' ') + body + "\n";
  };
  if (pos_out_ != nullptr) {
    s += "\n";
    row(pos_metavar_, pos_help_);
  }
  s += "\n";
  for (const HelpLine& l : layout_) {
    if (l.option < 0) {
      s += "\n" + l.title + "\n";
      continue;
    }
    const Option& o = options_[size_t(l.option)];
    std::string left;
    for (const std::string& n : o.names) left += (left.empty() ? "" : ", ") + n;
    if (!o.metavar.empty()) left += " " + o.metavar;
    std::string text = o.help;
    if (!o.default_text.empty() && !o.metavar.empty()) {
      // On the text's last line when it fits in 100 columns, else on a line of its own.
      const size_t nl = text.rfind('\n');
      const size_t last = nl == std::string::npos ? text.size() : text.size() - nl - 1;
      const std::string def = "(default " + o.default_text + ")";
      text += (26 + last + 1 + def.size() <= 100 ? " " : "\n") + def;
    }
    row(left, text);
  }
  row("-h, --help", "this text");
  for (size_t at; (at = s.find("\n\n\n")) != std::string::npos;) s.erase(at, 1);
  return s;
}

std::string without_location(const std::string& what) { return strip_location(what); }

void check_stdout() {
  errno = 0;
  const bool flushed = std::fflush(stdout) == 0;
  const int err = errno;
  if (flushed && !std::ferror(stdout)) return;
  throw Error(std::string("cannot write to standard output") +
              (err != 0 ? std::string(": ") + std::strerror(err) : std::string()));
}

void check_thread_variables() {
  // libgomp starts OMP_NUM_THREADS threads at the first parallel region and crashes when it
  // cannot (each takes a stack): refuse a count no machine of this size could serve.
  const char* v = std::getenv("OMP_NUM_THREADS");
  if (v == nullptr) return;
  const std::string value(v);
  const std::string first = value.substr(0, value.find(','));  // "outer,inner" for nested regions
  const size_t digits = first.find_first_not_of(" \t");
  if (digits == std::string::npos) return;
  errno = 0;
  char* end = nullptr;
  const unsigned long long n = std::strtoull(first.c_str() + digits, &end, 10);
  if (end == first.c_str() + digits) return;  // not a number: libgomp ignores it
  const unsigned long long hw = std::max(1u, std::thread::hardware_concurrency());
  const unsigned long long limit = std::max(256ull, 16 * hw);
  if (errno == ERANGE || n > limit)
    throw UsageError("OMP_NUM_THREADS=" + text::printable(value) + ": more threads than this " +
                     "machine can start (it has " + std::to_string(hw) +
                     " hardware threads); set it to at most " + std::to_string(limit) +
                     ", or unset it");
}

int run_tool(const std::string& program, const std::function<int()>& body) {
  try {
    check_thread_variables();
    const int code = body();
    check_stdout();
    return code;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    // One line, whatever the message quotes (a flag value or a path with a newline in it).
    std::fprintf(stderr, "%s: error: %s\n", program.c_str(), text::printable(e.what()).c_str());
    return 1;
  }
}

}  // namespace kiln::cli
