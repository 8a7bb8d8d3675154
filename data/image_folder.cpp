#include "data/image_folder.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <set>

#include "core/error.h"

namespace kiln::data {

namespace fs = std::filesystem;

bool has_image_extension(const std::string& path) {
  std::string ext = fs::path(path).extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(),
                 [](unsigned char c) { return char(std::tolower(c)); });
  return ext == ".jpg" || ext == ".jpeg" || ext == ".png";
}

ImageFolder::ImageFolder(const std::string& root) : root_(root) {
  std::error_code ec;
  KILN_CHECK(fs::exists(root, ec), "ImageFolder: '", root, "' does not exist");
  KILN_CHECK(fs::is_directory(root, ec), "ImageFolder: '", root, "' is not a folder");

  for (const auto& entry : fs::directory_iterator(root, ec))
    if (entry.is_directory(ec)) classes_.push_back(entry.path().filename().string());
  KILN_CHECK(!ec, "ImageFolder: cannot list '", root, "': ", ec.message());
  KILN_CHECK(!classes_.empty(), "ImageFolder: '", root,
             "' has no class folders (expected root/<class>/<image files>)");
  std::sort(classes_.begin(), classes_.end());

  // Canonical class folders, to refuse links from one class into another.
  std::vector<fs::path> class_roots;
  for (const std::string& c : classes_) {
    class_roots.push_back(fs::canonical(fs::path(root) / c, ec));
    KILN_CHECK(!ec, "ImageFolder: cannot resolve '", (fs::path(root) / c).string(),
               "': ", ec.message());
  }
  auto inside = [](const fs::path& p, const fs::path& dir) {
    auto [d, q] = std::mismatch(dir.begin(), dir.end(), p.begin(), p.end());
    return d == dir.end();
  };
  const fs::path real_root = fs::canonical(root, ec);
  auto system_folder = [&](const fs::path& p) {
    for (const char* sys : {"/proc", "/sys", "/dev"})
      if (inside(p, sys)) return true;
    return false;
  };
  std::set<fs::path> visited;  // canonical folders already walked
  std::vector<std::string> empty_classes;
  for (size_t c = 0; c < classes_.size(); ++c) {
    const fs::path dir = fs::path(root) / classes_[c];
    std::vector<std::string> files;
    // Depth-first with an explicit stack; errors (permissions) are reported rather than silently
    // dropping a folder's files.
    std::vector<fs::path> stack = {dir};
    visited.insert(class_roots[c]);
    while (!stack.empty()) {
      const fs::path d = stack.back();
      stack.pop_back();
      fs::directory_iterator it(d, ec);
      KILN_CHECK(!ec, "ImageFolder: cannot list '", d.string(), "': ", ec.message());
      for (; it != fs::directory_iterator(); it.increment(ec)) {
        KILN_CHECK(!ec, "ImageFolder: cannot list '", d.string(), "': ", ec.message());
        const fs::path p = it->path();
        if (it->is_directory(ec)) {
          const fs::path real = fs::canonical(p, ec);
          KILN_CHECK(!ec, "ImageFolder: cannot resolve '", p.string(), "': ", ec.message());
          bool other_class = false;
          for (size_t k = 0; k < class_roots.size(); ++k)
            other_class |= k != c && inside(real, class_roots[k]);
          // A link to a folder holding the data itself (/, a parent) would walk the data again
          // and everything around it; /proc, /sys and /dev hold no photographs.
          const char* why = other_class                     ? "inside another class folder"
                            : inside(real_root, real)       ? "it holds the data folder itself"
                            : system_folder(real)           ? "a system folder"
                            : !visited.insert(real).second ? "already visited: a loop?"
                                                            : nullptr;
          if (why != nullptr) {
            // Named for the first ten; the rest counted (skipped_links()).
            if (++skipped_links_ <= 10)
              std::fprintf(stderr,
                           "kiln: warning: ImageFolder: not following '%s' -> '%s' (%s)%s\n",
                           p.c_str(), real.c_str(), why,
                           skipped_links_ == 10 ? "; further links not followed are only counted"
                                                : "");
            continue;
          }
          stack.push_back(p);
        } else if (it->is_regular_file(ec) && has_image_extension(p.string())) {
          files.push_back(p.string());
        }
      }
      KILN_CHECK(!ec, "ImageFolder: cannot list '", d.string(), "': ", ec.message());
    }
    if (files.empty()) empty_classes.push_back(dir.string());
    std::sort(files.begin(), files.end());
    for (auto& f : files) samples_.push_back({std::move(f), int64_t(c)});
  }
  if (!empty_classes.empty()) {
    std::string list;
    for (const auto& d : empty_classes) list += (list.empty() ? "'" : ", '") + d + "'";
    KILN_FAIL("ImageFolder: no image files (.jpg, .jpeg, .png) in class folder",
              empty_classes.size() > 1 ? "s " : " ", list);
  }
}

}  // namespace kiln::data
