#include "common/thread.h"

#include <pthread.h>

#include <string>

namespace leap {

void NameThisThread(std::string_view name) {
  const std::string n(name.substr(0, 15));
  pthread_setname_np(pthread_self(), n.c_str());
}

}  // namespace leap
