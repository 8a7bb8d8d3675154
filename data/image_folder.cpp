#include "data/image_folder.h"

#include <algorithm>
#include <cctype>
#include <filesystem>

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

  std::vector<std::string> empty_classes;
  for (size_t c = 0; c < classes_.size(); ++c) {
    const fs::path dir = fs::path(root) / classes_[c];
    std::vector<std::string> files;
    // follow_directory_symlink as torchvision's os.walk(followlinks=True); errors inside a class
    // folder (permissions) are reported rather than silently dropping its files.
    fs::recursive_directory_iterator it(dir, fs::directory_options::follow_directory_symlink, ec);
    KILN_CHECK(!ec, "ImageFolder: cannot list '", dir.string(), "': ", ec.message());
    for (; it != fs::recursive_directory_iterator(); it.increment(ec)) {
      KILN_CHECK(!ec, "ImageFolder: cannot list '", dir.string(), "': ", ec.message());
      if (it->is_regular_file(ec) && has_image_extension(it->path().string()))
        files.push_back(it->path().string());
    }
    KILN_CHECK(!ec, "ImageFolder: cannot list '", dir.string(), "': ", ec.message());
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
