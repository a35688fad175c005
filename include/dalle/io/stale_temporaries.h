#pragma once
// Temporary files and folders (io::temporary_sibling's `<name>.tmp-<pid>-<n>`) that a
// killed process left behind: a checkpoint, token dataset or output folder half written.
// Those whose process is gone are removed when the next run writes the same place.
#include <string>

namespace dalle::io {

// Removes `<path>.tmp-<pid>-<n>` siblings of `path` whose process no longer runs.
void remove_stale_temporaries(const std::string& path);
// Removes every `<name>.tmp-<pid>-<n>` entry of `directory` whose process no longer runs:
// for folders whose every entry this library writes, such as a run's checkpoints/.
void remove_stale_temporaries_in(const std::string& directory);

}  // namespace dalle::io
