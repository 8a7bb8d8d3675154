#pragma once
// ImageFolder: a dataset laid out as root/<class>/<image>, as torchvision's ImageFolder reads it.
//
//   root/cat/001.jpg  root/cat/sub/002.PNG  root/dog/xyz.jpeg   ->  classes {"cat", "dog"}
//
// Class folders are the sub-folders of root, sorted by name (byte order); class i is the i-th.
// Files are found recursively inside each class folder and kept when their extension is .jpg,
// .jpeg or .png (any case); samples are sorted by path within a class, classes in class order.
// The constructor only lists files: nothing is decoded, and nothing under root is ever written.
// Symbolic links to folders are followed (as os.walk(followlinks=True)) unless the target was
// already visited (a loop, or the same folder twice), lies inside another class folder (its
// images would get this class's label), holds root itself (a link to / or to a parent) or lies
// in /proc, /sys or /dev; such links are skipped, counted (skipped_links()) and, the first ten,
// named in a warning on stderr.
// Errors (kiln::Error, naming the path): root missing or not a folder, no class folders, a
// class folder without any image file.
#include <cstdint>
#include <string>
#include <vector>

namespace kiln::data {

struct ImageSample {
  std::string path;
  int64_t label = 0;
};

class ImageFolder {
 public:
  explicit ImageFolder(const std::string& root);

  const std::string& root() const { return root_; }
  const std::vector<std::string>& classes() const { return classes_; }
  const std::vector<ImageSample>& samples() const { return samples_; }
  int64_t size() const { return int64_t(samples_.size()); }
  int64_t num_classes() const { return int64_t(classes_.size()); }
  const ImageSample& operator[](int64_t i) const { return samples_[size_t(i)]; }
  int64_t skipped_links() const { return skipped_links_; }

 private:
  std::string root_;
  std::vector<std::string> classes_;
  std::vector<ImageSample> samples_;
  int64_t skipped_links_ = 0;
};

// Whether `path` ends in .jpg, .jpeg or .png, case-insensitively.
bool has_image_extension(const std::string& path);

}  // namespace kiln::data
