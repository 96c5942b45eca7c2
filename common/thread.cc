#include "common/thread.h"

#include <pthread.h>

#include <string>

namespace leap {

void NameThread(std::thread& t, std::string_view name) {
  const std::string n(name.substr(0, 15));
  pthread_setname_np(t.native_handle(), n.c_str());
}

}  // namespace leap
