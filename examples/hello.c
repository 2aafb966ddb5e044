/* Pin host memory, copy it to the device on a stream, and give everything back. */
#include <pinmem.h>
#include <stdio.h>
#include <string.h>

#define TRY(call)                                                                \
  do {                                                                           \
    pm_status_t st_ = (call);                                                    \
    if (st_ != PM_OK) {                                                          \
      fprintf(stderr, "%s: %s: %s\n", #call, pm_strerror(st_), pm_last_error()); \
      return 1;                                                                  \
    }                                                                            \
  } while (0)

int main(void) {
  size_t bytes = 1 << 20;
  void *host, *dev;
  pm_stream_t stream;
  TRY(pm_host_alloc(NULL, bytes, PM_HOST_DEFAULT, &host)); /* pinned, from the default pool */
  memset(host, 0x5a, bytes);
  TRY(pm_device_alloc(bytes, &dev));
  TRY(pm_stream_create(&stream));
  TRY(pm_memcpy_async(dev, host, bytes, PM_COPY_H2D, stream)); /* DMA; returns at once */
  TRY(pm_stream_synchronize(stream)); /* host may be reused only after this */
  printf("copied %zu bytes to the device (%s backend)\n", bytes, pm_backend_name());
  TRY(pm_stream_destroy(stream));
  TRY(pm_device_free(dev));
  TRY(pm_host_free(host));
  return 0;
}
