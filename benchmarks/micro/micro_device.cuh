// The micro benchmarks' host side, one home: the GPU's SM count and clock, a scratch output buffer, and the best of
// a few timed launches (cuda events). Included by the benchmarks/micro/*.cu files (each builds alone with nvcc).
#pragma once
#include <cstdio>
#include <cuda_runtime.h>

struct MicroDevice {
  int sms;
  double ghz;  // the maximum SM clock: cycles = seconds x ghz x 1e9
  float* out;  // a buffer of floats_per_sm x sms floats, where kernels leave a result (so no work is dead)
};

inline MicroDevice micro_device(int floats_per_sm) {
  MicroDevice d;
  int clk;
  cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, 0);
  cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, 0);
  d.ghz = clk / 1e6;
  cudaMalloc(&d.out, (size_t)d.sms * floats_per_sm * sizeof(float));
  return d;
}

// The shortest of `reps` timed calls of launch() (after one untimed warm-up call), in SM cycles at the max clock.
template <class Launch>
double best_cycles(const MicroDevice& d, Launch launch, int reps = 5) {
  launch();
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  float best = 1e30f;
  for (int r = 0; r < reps; ++r) {
    cudaEventRecord(e0);
    launch();
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms;
    cudaEventElapsedTime(&ms, e0, e1);
    best = ms < best ? ms : best;
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return best * 1e-3 * d.ghz * 1e9;
}
