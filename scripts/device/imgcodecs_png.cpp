// Device-machine stand-in for libopencv_imgcodecs.so.406: PNG only, through libpng's
// simplified API. Debian's imgcodecs pulls in 160 MB of GDAL and friends, more than a device
// run may carry; the library calls only imdecode and imencode.
#include <png.h>

#include <opencv2/core.hpp>
#include <string>
#include <vector>

namespace cv {

Mat imdecode(InputArray buf, int) {
  const Mat bytes = buf.getMat();
  png_image image{};
  image.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_memory(&image, bytes.data, bytes.total() * bytes.elemSize())) return Mat();
  int type = CV_8UC3;
  if (image.format & PNG_FORMAT_FLAG_ALPHA) {
    image.format = PNG_FORMAT_BGRA;
    type = CV_8UC4;
  } else if (image.format & PNG_FORMAT_FLAG_COLOR) {
    image.format = PNG_FORMAT_BGR;
  } else {
    image.format = PNG_FORMAT_GRAY;
    type = CV_8UC1;
  }
  Mat out(static_cast<int>(image.height), static_cast<int>(image.width), type);
  if (!png_image_finish_read(&image, nullptr, out.data, static_cast<png_int_32>(out.step), nullptr)) return Mat();
  return out;
}

bool imencode(const String& ext, InputArray img, std::vector<uchar>& buf, const std::vector<int>&) {
  if (ext != ".png") return false;
  const Mat mat = img.getMat();
  if (mat.depth() != CV_8U || (mat.channels() != 1 && mat.channels() != 3)) return false;
  png_image image{};
  image.version = PNG_IMAGE_VERSION;
  image.width = static_cast<png_uint_32>(mat.cols);
  image.height = static_cast<png_uint_32>(mat.rows);
  image.format = mat.channels() == 3 ? PNG_FORMAT_BGR : PNG_FORMAT_GRAY;
  png_alloc_size_t size = 0;
  if (!png_image_write_to_memory(&image, nullptr, &size, 0, mat.data, static_cast<png_int_32>(mat.step), nullptr)) {
    return false;
  }
  buf.resize(size);
  return png_image_write_to_memory(&image, buf.data(), &size, 0, mat.data, static_cast<png_int_32>(mat.step),
                                   nullptr) != 0;
}

}  // namespace cv
