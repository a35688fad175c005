// Device-machine stand-in for libopencv_imgcodecs.so.406: PNG through libpng's simplified
// API and JPEG through libjpeg(-turbo). Debian's imgcodecs pulls in 160 MB of GDAL and
// friends, more than a device run may carry; the library calls only imdecode and imencode
// (JPEG for super-resolution's degradations, PNG for everything else).
// jpeglib.h needs size_t and FILE declared before it.
#include <cstddef>
#include <cstdio>
// clang-format off
#include <jpeglib.h>
// clang-format on
#include <png.h>

#include <csetjmp>
#include <cstdlib>
#include <opencv2/core.hpp>
#include <opencv2/imgcodecs.hpp>
#include <string>
#include <vector>

namespace {

struct JpegError {
  jpeg_error_mgr manager;
  std::jmp_buf jump;
};

void on_jpeg_error(j_common_ptr info) { std::longjmp(reinterpret_cast<JpegError*>(info->err)->jump, 1); }

cv::Mat decode_png(const cv::Mat& bytes) {
  png_image image{};
  image.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_memory(&image, bytes.data, bytes.total() * bytes.elemSize())) return cv::Mat();
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
  cv::Mat out(static_cast<int>(image.height), static_cast<int>(image.width), type);
  if (!png_image_finish_read(&image, nullptr, out.data, static_cast<png_int_32>(out.step), nullptr)) return cv::Mat();
  return out;
}

// Every object that outlives a longjmp is declared before its setjmp.
cv::Mat decode_jpeg(const cv::Mat& bytes) {
  jpeg_decompress_struct info{};
  JpegError error{};
  cv::Mat out;
  info.err = jpeg_std_error(&error.manager);
  error.manager.error_exit = on_jpeg_error;
  if (setjmp(error.jump)) {
    jpeg_destroy_decompress(&info);
    return cv::Mat();
  }
  jpeg_create_decompress(&info);
  jpeg_mem_src(&info, bytes.data, static_cast<unsigned long>(bytes.total() * bytes.elemSize()));
  jpeg_read_header(&info, TRUE);
  info.out_color_space = JCS_EXT_BGR;  // cv::IMREAD_COLOR
  jpeg_start_decompress(&info);
  out.create(static_cast<int>(info.output_height), static_cast<int>(info.output_width), CV_8UC3);
  while (info.output_scanline < info.output_height) {
    JSAMPROW row = out.ptr(static_cast<int>(info.output_scanline));
    jpeg_read_scanlines(&info, &row, 1);
  }
  jpeg_finish_decompress(&info);
  jpeg_destroy_decompress(&info);
  return out;
}

bool encode_png(const cv::Mat& mat, std::vector<uchar>& buf) {
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

bool encode_jpeg(const cv::Mat& mat, int quality, std::vector<uchar>& buf) {
  jpeg_compress_struct info{};
  JpegError error{};
  unsigned char* out = nullptr;
  unsigned long size = 0;
  info.err = jpeg_std_error(&error.manager);
  error.manager.error_exit = on_jpeg_error;
  if (setjmp(error.jump)) {
    jpeg_destroy_compress(&info);
    std::free(out);
    return false;
  }
  jpeg_create_compress(&info);
  jpeg_mem_dest(&info, &out, &size);
  info.image_width = static_cast<JDIMENSION>(mat.cols);
  info.image_height = static_cast<JDIMENSION>(mat.rows);
  info.input_components = mat.channels();
  info.in_color_space = mat.channels() == 3 ? JCS_EXT_BGR : JCS_GRAYSCALE;
  jpeg_set_defaults(&info);
  jpeg_set_quality(&info, quality, TRUE);
  jpeg_start_compress(&info, TRUE);
  while (info.next_scanline < info.image_height) {
    JSAMPROW row = const_cast<uchar*>(mat.ptr(static_cast<int>(info.next_scanline)));
    jpeg_write_scanlines(&info, &row, 1);
  }
  jpeg_finish_compress(&info);
  buf.assign(out, out + size);
  jpeg_destroy_compress(&info);
  std::free(out);
  return true;
}

}  // namespace

namespace cv {

Mat imdecode(InputArray buf, int) {
  const Mat bytes = buf.getMat();
  const bool jpeg = bytes.total() * bytes.elemSize() > 2 && bytes.data[0] == 0xFF && bytes.data[1] == 0xD8;
  return jpeg ? decode_jpeg(bytes) : decode_png(bytes);
}

bool imencode(const String& ext, InputArray img, std::vector<uchar>& buf, const std::vector<int>& params) {
  const Mat mat = img.getMat();
  if (mat.depth() != CV_8U || (mat.channels() != 1 && mat.channels() != 3)) return false;
  if (ext == ".png") return encode_png(mat, buf);
  if (ext != ".jpg" && ext != ".jpeg") return false;
  int quality = 95;  // OpenCV's default
  for (size_t i = 0; i + 1 < params.size(); i += 2) {
    if (params[i] == IMWRITE_JPEG_QUALITY) quality = params[i + 1];
  }
  return encode_jpeg(mat, quality, buf);
}

}  // namespace cv
