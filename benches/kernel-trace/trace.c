// In-run kernel timeline through CUPTI's activity API, for any CUDA program (mold, PyTorch),
// loaded by the CUDA driver itself: CUDA_INJECTION64_PATH=libtrace.so. Every kernel, memcpy
// and memset the GPU ran is written at exit as CSV (start_ns,end_ns,device,stream,kind,name)
// to $KERNEL_TRACE_OUT (default kernel-trace.PID.csv). Unlike Nsight Compute, the kernels run as
// the program runs them (back to back, at the run's clocks), so the gaps between them are the
// run's own: benches/kernel-trace/gaps.py reads them.
// With KERNEL_TRACE_MEMORY=PATH ("%p" as above) it also writes, to PATH, every allocation and
// free the driver saw (stream-ordered pool allocations included) and every kernel launch and
// copy, each with its API call's correlation id (the order the host issued them in), as CSV
// (corr,timestamp_ns,device,stream,op,address,bytes,name): benches/kernel-trace/peak.py
// finds the peak of memory in use and lists what was alive then and which kernel wrote it.
// Build (on the GPU machine): benches/kernel-trace/build
#include <cupti.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define BUF_SIZE (2u << 20)
static FILE *out;
static FILE *mem; // KERNEL_TRACE_MEMORY: allocations, frees and launches by correlation id

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
  *buffer = (uint8_t *)aligned_alloc(8, BUF_SIZE);
  *size = *buffer ? BUF_SIZE : 0;
  *max_records = 0;
}

static void csv_name(FILE *f, const char *name) {
  // names are mangled C++ symbols: no commas or quotes in practice; guard anyway
  for (const char *p = name ? name : "?"; *p; p++) fputc(*p == ',' ? ';' : *p, f);
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream_id, uint8_t *buffer,
                                      size_t size, size_t valid) {
  (void)ctx;
  (void)stream_id;
  (void)size;
  CUpti_Activity *rec = NULL;
  while (out && cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    switch (rec->kind) {
    case CUPTI_ACTIVITY_KIND_KERNEL:
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
      CUpti_ActivityKernel9 *k = (CUpti_ActivityKernel9 *)rec;
      fprintf(out, "%llu,%llu,%u,%u,kernel,", (unsigned long long)k->start,
              (unsigned long long)k->end, k->deviceId, k->streamId);
      csv_name(out, k->name);
      fputc('\n', out);
      if (mem) {
        fprintf(mem, "%u,%llu,%u,%u,kernel,0,0,", k->correlationId,
                (unsigned long long)k->start, k->deviceId, k->streamId);
        csv_name(mem, k->name);
        fputc('\n', mem);
      }
      break;
    }
    case CUPTI_ACTIVITY_KIND_MEMCPY: {
      CUpti_ActivityMemcpy6 *m = (CUpti_ActivityMemcpy6 *)rec;
      fprintf(out, "%llu,%llu,%u,%u,memcpy,kind%u_%llu_bytes\n", (unsigned long long)m->start,
              (unsigned long long)m->end, m->deviceId, m->streamId, (unsigned)m->copyKind,
              (unsigned long long)m->bytes);
      if (mem)
        fprintf(mem, "%u,%llu,%u,%u,memcpy,0,%llu,kind%u\n", m->correlationId,
                (unsigned long long)m->start, m->deviceId, m->streamId,
                (unsigned long long)m->bytes, (unsigned)m->copyKind);
      break;
    }
    case CUPTI_ACTIVITY_KIND_MEMORY2: {
      CUpti_ActivityMemory4 *m = (CUpti_ActivityMemory4 *)rec;
      const char *op = m->memoryOperationType == CUPTI_ACTIVITY_MEMORY_OPERATION_TYPE_ALLOCATION
                           ? "alloc"
                           : m->memoryOperationType == CUPTI_ACTIVITY_MEMORY_OPERATION_TYPE_RELEASE
                                 ? "free"
                                 : NULL;
      // device memory only (memoryKind 3): pinned host buffers are not the GPU's
      if (mem && op && m->memoryKind == CUPTI_ACTIVITY_MEMORY_KIND_DEVICE)
        fprintf(mem, "%u,%llu,%u,%u,%s,%llu,%llu,pool%u\n", m->correlationId,
                (unsigned long long)m->timestamp, m->deviceId, m->streamId, op,
                (unsigned long long)m->address, (unsigned long long)m->bytes,
                (unsigned)m->memoryPoolConfig.memoryPoolType);
      break;
    }
    case CUPTI_ACTIVITY_KIND_MEMSET: {
      CUpti_ActivityMemset4 *m = (CUpti_ActivityMemset4 *)rec;
      fprintf(out, "%llu,%llu,%u,%u,memset,%llu_bytes\n", (unsigned long long)m->start,
              (unsigned long long)m->end, m->deviceId, m->streamId,
              (unsigned long long)m->bytes);
      break;
    }
    default:
      break;
    }
  }
  size_t dropped = 0;
  if (cuptiActivityGetNumDroppedRecords(ctx, stream_id, &dropped) == CUPTI_SUCCESS && dropped)
    fprintf(stderr, "kernel-trace: %zu records dropped\n", dropped);
  free(buffer);
}

static void finish(void) {
  cuptiActivityFlushAll(1);
  if (out) {
    fclose(out);
    out = NULL;
  }
  if (mem) {
    fclose(mem);
    mem = NULL;
  }
}

static int check(CUptiResult r, const char *what) {
  if (r == CUPTI_SUCCESS) return 1;
  const char *msg = "?";
  cuptiGetResultString(r, &msg);
  fprintf(stderr, "kernel-trace: %s failed: %s\n", what, msg);
  return 0;
}

// KERNEL_TRACE_OUT with "%p" in it: the process id replaces it (a program whose child
// processes use CUDA too, e.g. torch.compile's workers, then writes one file per process).
static void out_path(char *buf, size_t n, const char *var, const char *fallback) {
  const char *tpl = getenv(var);
  if (!tpl || !*tpl) tpl = fallback;
  const char *p = strstr(tpl, "%p");
  if (p)
    snprintf(buf, n, "%.*s%ld%s", (int)(p - tpl), tpl, (long)getpid(), p + 2);
  else
    snprintf(buf, n, "%s", tpl);
}

int InitializeInjection(void) {
  char path[4096];
  out_path(path, sizeof path, "KERNEL_TRACE_OUT", "kernel-trace.%p.csv");
  out = fopen(path, "w");
  if (!out) {
    fprintf(stderr, "kernel-trace: cannot write %s\n", path);
    return 0;
  }
  fputs("start_ns,end_ns,device,stream,kind,name\n", out);
  if (!check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed),
             "cuptiActivityRegisterCallbacks") ||
      !check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enable kernels"))
    return 0;
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "enable memcpy");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET), "enable memset");
  const char *want_mem = getenv("KERNEL_TRACE_MEMORY");
  if (want_mem && *want_mem) {
    char mpath[4096];
    out_path(mpath, sizeof mpath, "KERNEL_TRACE_MEMORY", "");
    mem = fopen(mpath, "w");
    if (!mem)
      fprintf(stderr, "kernel-trace: cannot write %s\n", mpath);
    else {
      fputs("corr,timestamp_ns,device,stream,op,address,bytes,name\n", mem);
      if (!check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMORY2), "enable memory")) {
        fclose(mem);
        mem = NULL;
      }
    }
  }
  // hand full and partly filled buffers over while the program runs, not only at its exit
  // (the driver may tear its context down before an atexit handler runs)
  check(cuptiActivityFlushPeriod(200), "cuptiActivityFlushPeriod");
  atexit(finish);
  fprintf(stderr, "kernel-trace: tracing to %s\n", path);
  return 1;
}
