#include "tools/leapctl/flags.h"

#include <cmath>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace leap::leapctl {
namespace {

std::string FormatDouble(double v) { return absl::StrFormat("%g", v); }

// A finite double into *dst (a plain double or an optional one); false
// leaves *dst as it was.
template <class T>
bool ParseFinite(absl::string_view v, T* dst) {
  double x = 0;
  if (!absl::SimpleAtod(v, &x) || !std::isfinite(x)) return false;
  *dst = x;
  return true;
}

// Appends `head` on its own line, then `text` wrapped at ~80 columns and
// indented under it.
void AppendEntry(const std::string& head, const std::string& text,
                 std::string* out) {
  constexpr size_t kIndent = 6;
  constexpr size_t kWidth = 80;
  absl::StrAppend(out, head, "\n");
  std::string line(kIndent, ' ');
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find(' ', pos);
    if (end == std::string::npos) end = text.size();
    const std::string word = text.substr(pos, end - pos);
    if (line.size() > kIndent && line.size() + 1 + word.size() > kWidth) {
      absl::StrAppend(out, line, "\n");
      line.assign(kIndent, ' ');
    }
    if (line.size() > kIndent) line += ' ';
    line += word;
    pos = end + 1;
  }
  if (line.size() > kIndent) absl::StrAppend(out, line, "\n");
}

}  // namespace

FlagSet::FlagSet(std::string command, std::string usage,
                 std::string description)
    : command_(std::move(command)),
      usage_(std::move(usage)),
      description_(std::move(description)) {
  Flag help;
  help.name = "help";
  help.help = "Print this help and exit.";
  help.parse = [](absl::string_view) { return true; };  // see Parse()
  flags_.push_back(std::move(help));
}

void FlagSet::Add(const std::string& name, const std::string& value_name,
                  std::string help,
                  std::function<bool(absl::string_view)> parse,
                  std::string default_text, bool required, bool repeatable) {
  Flag f;
  f.name = name;
  f.value_name = value_name;
  f.help = std::move(help);
  f.default_text = std::move(default_text);
  f.required = required;
  f.repeatable = repeatable;
  f.parse = std::move(parse);
  flags_.push_back(std::move(f));
}

void FlagSet::String(const std::string& name, std::string* dst,
                     const std::string& value_name, const std::string& help,
                     bool required) {
  Add(name, value_name, help,
      [dst](absl::string_view v) {
        *dst = std::string(v);
        return !v.empty();
      },
      !required && !dst->empty() ? *dst : std::string(), required);
}

void FlagSet::Int64(const std::string& name, int64_t* dst,
                    const std::string& value_name, const std::string& help,
                    bool required) {
  Add(name, value_name, help,
      [dst](absl::string_view v) { return absl::SimpleAtoi(v, dst); },
      required ? std::string() : absl::StrCat(*dst), required);
}

void FlagSet::Double(const std::string& name, double* dst,
                     const std::string& value_name, const std::string& help) {
  Add(name, value_name, help,
      [dst](absl::string_view v) { return ParseFinite(v, dst); },
      FormatDouble(*dst));
}

void FlagSet::OptionalDouble(const std::string& name,
                             std::optional<double>* dst,
                             const std::string& value_name,
                             const std::string& help) {
  Add(name, value_name, help,
      [dst](absl::string_view v) { return ParseFinite(v, dst); });
}

void FlagSet::OptionalInt64(const std::string& name,
                            std::optional<int64_t>* dst,
                            const std::string& value_name,
                            const std::string& help) {
  Add(name, value_name, help, [dst](absl::string_view v) {
    int64_t x = 0;
    if (!absl::SimpleAtoi(v, &x)) return false;
    *dst = x;
    return true;
  });
}

void FlagSet::Bool(const std::string& name, bool* dst,
                   const std::string& help) {
  Add(name, "", help, [dst](absl::string_view) {
    *dst = true;
    return true;
  });
}

void FlagSet::StringList(const std::string& name, std::vector<std::string>* dst,
                         const std::string& value_name,
                         const std::string& help) {
  Add(
      name, value_name, absl::StrCat(help, " Repeatable."),
      [dst](absl::string_view v) {
        if (v.empty()) return false;
        dst->emplace_back(v);
        return true;
      },
      "", false, /*repeatable=*/true);
}

void FlagSet::Positional(const std::string& name, std::string* dst,
                         const std::string& help, bool required) {
  Arg a;
  a.name = name;
  a.help = help;
  a.required = required;
  a.dst = dst;
  args_.push_back(std::move(a));
}

absl::Status FlagSet::TakePositional(const std::string& value) {
  for (Arg& a : args_) {
    if (a.set) continue;
    a.set = true;
    *a.dst = value;
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unexpected argument '", value, "'",
      args_.empty() ? " (flags are --name VALUE)" : " (too many arguments)"));
}

FlagSet::Flag* FlagSet::Find(absl::string_view name) {
  for (Flag& f : flags_) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

bool FlagSet::WasSet(const std::string& name) const {
  for (const Flag& f : flags_) {
    if (f.name == name) return f.set;
  }
  for (const Arg& a : args_) {
    if (a.name == name) return a.set;
  }
  return false;
}

absl::Status FlagSet::Parse(const std::vector<std::string>& args) {
  bool only_positionals = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (only_positionals) {
      if (absl::Status s = TakePositional(arg); !s.ok()) return s;
      continue;
    }
    if (arg == "-h") {
      help_requested_ = true;
      continue;
    }
    if (arg == "--") {
      only_positionals = true;
      continue;
    }
    if (arg.size() < 3 || arg.compare(0, 2, "--") != 0) {
      if (absl::Status s = TakePositional(arg); !s.ok()) return s;
      continue;
    }
    std::string name = arg.substr(2);
    std::optional<std::string> inline_value;
    if (const size_t eq = name.find('='); eq != std::string::npos) {
      inline_value = name.substr(eq + 1);
      name.resize(eq);
    }
    Flag* f = Find(name);
    if (f == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
    }
    if (f->set && f->name != "help" && !f->repeatable) {
      return absl::InvalidArgumentError(
          absl::StrCat("flag --", name, " given more than once"));
    }
    f->set = true;
    if (f->name == "help") help_requested_ = true;
    if (f->value_name.empty()) {  // boolean
      if (inline_value.has_value()) {
        return absl::InvalidArgumentError(
            absl::StrCat("flag --", name, " takes no value"));
      }
      f->parse("");
      continue;
    }
    std::string value;
    if (inline_value.has_value()) {
      value = *inline_value;
    } else {
      if (i + 1 >= args.size()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "flag --", name, " needs a value (", f->value_name, ")"));
      }
      value = args[++i];
    }
    if (!f->parse(value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("invalid value '", value, "' for --", name,
                       " (expected ", f->value_name, ")"));
    }
  }
  if (help_requested_) return absl::OkStatus();
  for (const Arg& a : args_) {
    if (a.required && !a.set) {
      return absl::InvalidArgumentError(
          absl::StrCat("missing required argument ", a.name));
    }
  }
  for (const Flag& f : flags_) {
    if (f.required && !f.set) {
      return absl::InvalidArgumentError(
          absl::StrCat("missing required flag --", f.name));
    }
  }
  return absl::OkStatus();
}

std::string FlagSet::Help() const {
  std::string out = absl::StrCat("Usage: ", usage_, "\n\n", description_);
  if (!out.empty() && out.back() != '\n') out += '\n';
  if (!args_.empty()) {
    out += "\nArguments:\n";
    for (const Arg& a : args_) {
      AppendEntry(absl::StrCat("  ", a.name),
                  absl::StrCat(a.help, a.required ? " Required." : ""), &out);
    }
  }
  out += "\nFlags:\n";
  for (const Flag& f : flags_) {
    std::string head = absl::StrCat("  --", f.name);
    if (!f.value_name.empty()) absl::StrAppend(&head, " ", f.value_name);
    std::string text = f.help;
    if (f.required) {
      absl::StrAppend(&text, " Required.");
    } else if (!f.default_text.empty()) {
      absl::StrAppend(&text, " Default: ", f.default_text, ".");
    }
    AppendEntry(head, text, &out);
  }
  return out;
}

}  // namespace leap::leapctl
