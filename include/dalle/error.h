#pragma once
#include <stdexcept>
#include <string>

namespace dalle {

// Every error the library reports to a user: the message names the file, key or line at
// fault and what was expected. Tools print it and exit non-zero.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace dalle
