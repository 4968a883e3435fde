
#ifdef __CUDACC_RTC__
  #include <cuda/std/cstdint>
  using cuda::std::uint8_t;
  using cuda::std::uint16_t;
  using cuda::std::uint32_t;
  using cuda::std::uint64_t;
  using cuda::std::int8_t;
  using cuda::std::int16_t;
  using cuda::std::int32_t;
  using cuda::std::int64_t;

  #include <cuda/std/type_traits>
  namespace std {
    using cuda::std::is_same;
    using cuda::std::is_same_v;
    using cuda::std::is_integral;
    using cuda::std::is_signed;
    using cuda::std::is_unsigned;
    using cuda::std::is_floating_point;
    using cuda::std::enable_if;
    using cuda::std::conditional;
  }

  // NVRTC uses asm/volatile instead of __asm__/__volatile__ (gcc extension).
  #ifndef __asm__
  #define __asm__ asm
  #endif
  #ifndef __volatile__
  #define __volatile__ volatile
  #endif
#else
  #include <cstdint>
  #include <type_traits>
  #include <cuda.h>
#endif

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 700)
#define __shfl_sync(mask, var, lane, width) \
        __shfl((var), (lane), (width))

#define __shfl_down_sync(mask, var, offset, width) \
        __shfl_down((var), (offset), (width))

#define __shfl_up_sync(mask, var, offset, width) \
        __shfl_up((var), (offset), (width))
#endif

#if (((__CUDACC_VER_MAJOR__ == 11) && (__CUDACC_VER_MINOR__ >= 4)) || \
     (__CUDACC_VER_MAJOR__ > 11))
#define TVM_ENABLE_L2_PREFETCH 1
#else
#define TVM_ENABLE_L2_PREFETCH 0
#endif

#ifdef _WIN32
  using uint = unsigned int;
  using uchar = unsigned char;
  using ushort = unsigned short;
  using int64_t = long long;
  using uint64_t = unsigned long long;
#else
  #define uint unsigned int
  #define uchar unsigned char
  #define ushort unsigned short
#endif
extern "C" __global__ void __launch_bounds__(256) fused_matmul_add_relu_kernel(float* __restrict__ compute_intermediate_ptr, float* __restrict__ param_0_ptr, float* __restrict__ param_1_ptr, float* __restrict__ x_ptr);
extern "C" __global__ void __launch_bounds__(160) fused_matmul1_add1_relu1_kernel(float* __restrict__ compute_intermediate_ptr, float* __restrict__ lv3_ptr, float* __restrict__ param_0_ptr, float* __restrict__ param_1_ptr);
extern "C" __global__ void __launch_bounds__(256) fused_matmul2_add2_relu2_kernel(float* __restrict__ compute_intermediate_ptr, float* __restrict__ lv7_ptr, float* __restrict__ param_0_ptr, float* __restrict__ param_1_ptr);
extern "C" __global__ void __launch_bounds__(160) fused_matmul3_add3_kernel(float* __restrict__ T_add_intermediate_ptr, float* __restrict__ lv11_ptr, float* __restrict__ param_0_ptr, float* __restrict__ param_1_ptr);
extern "C" __global__ void __launch_bounds__(256) log_softmax_kernel(float* __restrict__ compute_ptr, float* __restrict__ lv14_ptr);
extern "C" __global__ void __launch_bounds__(256) fused_matmul_add_relu_kernel(float* __restrict__ compute_intermediate_ptr, float* __restrict__ param_0_ptr, float* __restrict__ param_1_ptr, float* __restrict__ x_ptr) {
  alignas(64) float matmul_intermediate_rf_local_ptr[1];
  __shared__ alignas(64) float red_buf0_ptr[256];
  matmul_intermediate_rf_local_ptr[0] = 0x0p+0f/*0.000000e+00*/;
  int cse_v1 = (((int)blockIdx.x) * 16);
  for (int ax1_fused_0 = 0; ax1_fused_0 < 7; ++ax1_fused_0) {
    if (((ax1_fused_0 * 4) + (((int)threadIdx.y) >> 2)) < 25) {
      matmul_intermediate_rf_local_ptr[0] = (matmul_intermediate_rf_local_ptr[0] + (x_ptr[((ax1_fused_0 * 16) + ((int)threadIdx.y))] * param_0_ptr[((((ax1_fused_0 * 6400) + (((int)threadIdx.y) * 400)) + (((int)blockIdx.x) * 16)) + ((int)threadIdx.x))]));
    }
  }
  __syncthreads();
  ((volatile float*)red_buf0_ptr)[((((int)threadIdx.x) * 16) + ((int)threadIdx.y))] = matmul_intermediate_rf_local_ptr[0];
  __syncthreads();
  if (((int)threadIdx.y) < 8) {
    ((volatile float*)red_buf0_ptr)[((((int)threadIdx.x) * 16) + ((int)threadIdx.y))] = (((volatile float*)red_buf0_ptr)[((((int)threadIdx.x) * 16) + ((int)threadIdx.y))] + ((volatile float*)red_buf0_ptr)[(((((int)threadIdx.x) * 16) + ((int)threadIdx.y)) + 8)]);
  }
  __syncthreads();
  if (((int)threadIdx.y) < 4) {
    ((volatile float*)red_buf0_ptr)[((((int)threadIdx.x) * 16) + ((int)threadIdx.y))] = (((volatile float*)red_buf0_ptr)[((((int)threadIdx.x) * 16) + ((int)threadIdx.y))] + ((volatile float*)red_buf0_ptr)[(((((int)threadIdx.x) * 16) + ((int)threadIdx.y)) + 4)]);
  }
  __syncthreads();
  if (((int)threadIdx.y) < 2) {
    ((volatile float*)red_buf0_ptr)[((((int)threadIdx.x) * 16) + ((int)threadIdx.y))] = (((volatile float*)red_buf0_ptr)[((((int)threadIdx.x) * 16) + ((int)threadIdx.y))] + ((volatile float*)red_buf0_ptr)[(((((int)threadIdx.x) * 16) + ((int)threadIdx.y)) + 2)]);
  }
  __syncthreads();
  if (((int)threadIdx.y) < 1) {
    ((volatile float*)red_buf0_ptr)[((((int)threadIdx.x) * 16) + ((int)threadIdx.y))] = (((volatile float*)red_buf0_ptr)[((((int)threadIdx.x) * 16) + ((int)threadIdx.y))] + ((volatile float*)red_buf0_ptr)[(((((int)threadIdx.x) * 16) + ((int)threadIdx.y)) + 1)]);
  }
  __syncthreads();
  if (((int)threadIdx.y) == 0) {
    int cse_v2 = ((((int)blockIdx.x) * 16) + ((int)threadIdx.x));
    compute_intermediate_ptr[((((int)blockIdx.x) * 16) + ((int)threadIdx.x))] = max((param_1_ptr[((((int)blockIdx.x) * 16) + ((int)threadIdx.x))] + ((volatile float*)red_buf0_ptr)[(((int)threadIdx.x) * 16)]), 0x0p+0f/*0.000000e+00*/);
  }
}

extern "C" __global__ void __launch_bounds__(160) fused_matmul1_add1_relu1_kernel(float* __restrict__ compute_intermediate_ptr, float* __restrict__ lv3_ptr, float* __restrict__ param_0_ptr, float* __restrict__ param_1_ptr) {
  alignas(64) float matmul_intermediate_rf_local_ptr[1];
  __shared__ alignas(64) float red_buf0_ptr[160];
  matmul_intermediate_rf_local_ptr[0] = 0x0p+0f/*0.000000e+00*/;
  int cse_v1 = (((int)blockIdx.x) * 10);
  for (int ax1_fused_0 = 0; ax1_fused_0 < 25; ++ax1_fused_0) {
    matmul_intermediate_rf_local_ptr[0] = (matmul_intermediate_rf_local_ptr[0] + (lv3_ptr[((ax1_fused_0 * 16) + ((int)threadIdx.y))] * param_0_ptr[((((ax1_fused_0 * 16000) + (((int)threadIdx.y) * 1000)) + (((int)blockIdx.x) * 10)) + ((int)threadIdx.x))]));
  }
  __syncthreads();
  ((volatile float*)red_buf0_ptr)[((((int)threadIdx.x) * 16) + ((int)threadIdx.y))] = matmul_intermediate_rf_local_ptr[0];
  __syncthreads();
  if (((int)threadIdx.y) < 8) {
    ((volatile float*)red_buf0_ptr)[((((int)threadIdx.x) * 16) + ((int)threadIdx.y))] = (((volatile float*)red_buf0_ptr)[((((int)threadIdx.x) * 16) + ((int)threadIdx.y))] + ((volatile float*)red_buf0_ptr)[(((((int)threadIdx.x) * 16) + ((int)threadIdx.y)) + 8)]);
  }
  __syncthreads();
  if (((int)threadIdx.y) < 4) {
    ((volatile float*)red_buf0_ptr)[((((int)threadIdx.x) * 16) + ((int)threadIdx.y))] = (((volatile float*)red_buf0_ptr)[((((int)threadIdx.x) * 16) + ((int)threadIdx.y))] + ((volatile float*)red_buf0_ptr)[(((((int)threadIdx.x) * 16) + ((int)threadIdx.y)) + 4)]);
  }
  __syncthreads();
  if (((int)threadIdx.y) < 2) {
    ((volatile float*)red_buf0_ptr)[((((int)threadIdx.x) * 16) + ((int)threadIdx.y))] = (((volatile float*)red_buf0_ptr)[((((int)threadIdx.x) * 16) + ((int)threadIdx.y))] + ((volatile float*)red_buf0_ptr)[(((((int)threadIdx.x) * 16) + ((int)threadIdx.y)) + 2)]);
  }
  __syncthreads();
  if (((int)threadIdx.y) < 1) {
    ((volatile float*)red_buf0_ptr)[((((int)threadIdx.x) * 16) + ((int)threadIdx.y))] = (((volatile float*)red_buf0_ptr)[((((int)threadIdx.x) * 16) + ((int)threadIdx.y))] + ((volatile float*)red_buf0_ptr)[(((((int)threadIdx.x) * 16) + ((int)threadIdx.y)) + 1)]);
  }
  __syncthreads();
  if (((int)threadIdx.y) == 0) {
    int cse_v2 = ((((int)blockIdx.x) * 10) + ((int)threadIdx.x));
    compute_intermediate_ptr[((((int)blockIdx.x) * 10) + ((int)threadIdx.x))] = max((param_1_ptr[((((int)blockIdx.x) * 10) + ((int)threadIdx.x))] + ((volatile float*)red_buf0_ptr)[(((int)threadIdx.x) * 16)]), 0x0p+0f/*0.000000e+00*/);
  }
}

extern "C" __global__ void __launch_bounds__(256) fused_matmul2_add2_relu2_kernel(float* __restrict__ compute_intermediate_ptr, float* __restrict__ lv7_ptr, float* __restrict__ param_0_ptr, float* __restrict__ param_1_ptr) {
  alignas(64) float matmul_intermediate_rf_local_ptr[1];
  __shared__ alignas(64) float red_buf0_ptr[256];
  matmul_intermediate_rf_local_ptr[0] = 0x0p+0f/*0.000000e+00*/;
  int cse_v1 = (((int)blockIdx.x) * 16);
  for (int ax1_fused_0 = 0; ax1_fused_0 < 63; ++ax1_fused_0) {
    if (((ax1_fused_0 * 2) + (((int)threadIdx.y) >> 3)) < 125) {
      matmul_intermediate_rf_local_ptr[0] = (matmul_intermediate_rf_local_ptr[0] + (lv7_ptr[((ax1_fused_0 * 16) + ((int)threadIdx.y))] * param_0_ptr[((((ax1_fused_0 * 32000) + (((int)threadIdx.y) * 2000)) + (((int)blockIdx.x) * 16)) + ((int)threadIdx.x))]));
    }
  }
  __syncthreads();
  ((volatile float*)red_buf0_ptr)[((((int)threadIdx.x) * 16) + ((int)threadIdx.y))] = matmul_intermediate_rf_local_ptr[0];
  __syncthreads();
  if (((int)threadIdx.y) < 8) {
    ((volatile float*)red_buf0_ptr)[((((int)threadIdx.x) * 16) + ((int)threadIdx.y))] = (((volatile float*)red_buf0_ptr)[((((int)threadIdx.x) * 16) + ((int)threadIdx.y))] + ((volatile float*)red_buf0_ptr)[(((((int)threadIdx.x) * 16) + ((int)threadIdx.y)) + 8)]);
  }
  __syncthreads();
  if (((int)threadIdx.y) < 4) {
    ((volatile float*)red_buf0_ptr)[((((int)threadIdx.x) * 16) + ((int)threadIdx.y))] = (((volatile float*)red_buf0_ptr)[((((int)threadIdx.x) * 16) + ((int)threadIdx.y))] + ((volatile float*)red_buf0_ptr)[(((((int)threadIdx.x) * 16) + ((int)threadIdx.y)) + 4)]);
  }
  __syncthreads();
  if (((int)threadIdx.y) < 2) {
    ((volatile float*)red_buf0_ptr)[((((int)threadIdx.x) * 16) + ((int)threadIdx.y))] = (((volatile float*)red_buf0_ptr)[((((int)threadIdx.x) * 16) + ((int)threadIdx.y))] + ((volatile float*)red_buf0_ptr)[(((((int)threadIdx.x) * 16) + ((int)threadIdx.y)) + 2)]);
  }
  __syncthreads();
  if (((int)threadIdx.y) < 1) {
    ((volatile float*)red_buf0_ptr)[((((int)threadIdx.x) * 16) + ((int)threadIdx.y))] = (((volatile float*)red_buf0_ptr)[((((int)threadIdx.x) * 16) + ((int)threadIdx.y))] + ((volatile float*)red_buf0_ptr)[(((((int)threadIdx.x) * 16) + ((int)threadIdx.y)) + 1)]);
  }
  __syncthreads();
  if (((int)threadIdx.y) == 0) {
    int cse_v2 = ((((int)blockIdx.x) * 16) + ((int)threadIdx.x));
    compute_intermediate_ptr[((((int)blockIdx.x) * 16) + ((int)threadIdx.x))] = max((param_1_ptr[((((int)blockIdx.x) * 16) + ((int)threadIdx.x))] + ((volatile float*)red_buf0_ptr)[(((int)threadIdx.x) * 16)]), 0x0p+0f/*0.000000e+00*/);
  }
}

extern "C" __global__ void __launch_bounds__(160) fused_matmul3_add3_kernel(float* __restrict__ T_add_intermediate_ptr, float* __restrict__ lv11_ptr, float* __restrict__ param_0_ptr, float* __restrict__ param_1_ptr) {
  alignas(64) float matmul_intermediate_rf_local_ptr[1];
  __shared__ alignas(64) float red_buf0_ptr[160];
  matmul_intermediate_rf_local_ptr[0] = 0x0p+0f/*0.000000e+00*/;
  for (int ax1_fused_0 = 0; ax1_fused_0 < 125; ++ax1_fused_0) {
    matmul_intermediate_rf_local_ptr[0] = (matmul_intermediate_rf_local_ptr[0] + (lv11_ptr[((ax1_fused_0 * 16) + ((int)threadIdx.y))] * param_0_ptr[(((ax1_fused_0 * 160) + (((int)threadIdx.y) * 10)) + ((int)threadIdx.x))]));
  }
  __syncthreads();
  ((volatile float*)red_buf0_ptr)[((((int)threadIdx.x) * 16) + ((int)threadIdx.y))] = matmul_intermediate_rf_local_ptr[0];
  __syncthreads();
  if (((int)threadIdx.y) < 8) {
    ((volatile float*)red_buf0_ptr)[((((int)threadIdx.x) * 16) + ((int)threadIdx.y))] = (((volatile float*)red_buf0_ptr)[((((int)threadIdx.x) * 16) + ((int)threadIdx.y))] + ((volatile float*)red_buf0_ptr)[(((((int)threadIdx.x) * 16) + ((int)threadIdx.y)) + 8)]);
  }
  __syncthreads();
  if (((int)threadIdx.y) < 4) {
    ((volatile float*)red_buf0_ptr)[((((int)threadIdx.x) * 16) + ((int)threadIdx.y))] = (((volatile float*)red_buf0_ptr)[((((int)threadIdx.x) * 16) + ((int)threadIdx.y))] + ((volatile float*)red_buf0_ptr)[(((((int)threadIdx.x) * 16) + ((int)threadIdx.y)) + 4)]);
  }
  __syncthreads();
  if (((int)threadIdx.y) < 2) {
    ((volatile float*)red_buf0_ptr)[((((int)threadIdx.x) * 16) + ((int)threadIdx.y))] = (((volatile float*)red_buf0_ptr)[((((int)threadIdx.x) * 16) + ((int)threadIdx.y))] + ((volatile float*)red_buf0_ptr)[(((((int)threadIdx.x) * 16) + ((int)threadIdx.y)) + 2)]);
  }
  __syncthreads();
  if (((int)threadIdx.y) < 1) {
    ((volatile float*)red_buf0_ptr)[((((int)threadIdx.x) * 16) + ((int)threadIdx.y))] = (((volatile float*)red_buf0_ptr)[((((int)threadIdx.x) * 16) + ((int)threadIdx.y))] + ((volatile float*)red_buf0_ptr)[(((((int)threadIdx.x) * 16) + ((int)threadIdx.y)) + 1)]);
  }
  __syncthreads();
  if (((int)threadIdx.y) == 0) {
    T_add_intermediate_ptr[((int)threadIdx.x)] = (param_1_ptr[((int)threadIdx.x)] + ((volatile float*)red_buf0_ptr)[(((int)threadIdx.x) * 16)]);
  }
}

extern "C" __global__ void __launch_bounds__(256) log_softmax_kernel(float* __restrict__ compute_ptr, float* __restrict__ lv14_ptr) {
  alignas(64) float in_thread_T_softmax_maxelem_shared_ptr[1];
  __shared__ alignas(64) float red_result_ptr[1];
  __shared__ alignas(64) float T_softmax_maxelem_shared_ptr[1];
  alignas(64) float in_thread_compute_shared_ptr[1];
  __shared__ alignas(64) float red_result_ptr_1[1];
  __shared__ alignas(64) float compute_shared_ptr[1];
  in_thread_T_softmax_maxelem_shared_ptr[0] = -0x1.fffffep+127f/*-3.402823e+38*/;
  if (((int)threadIdx.x) < 10) {
    in_thread_T_softmax_maxelem_shared_ptr[0] = max(in_thread_T_softmax_maxelem_shared_ptr[0], lv14_ptr[((int)threadIdx.x)]);
  }
  __shared__ alignas(64) float red_buf_staging_ptr[8];
  alignas(64) float t0_ptr[1];
  alignas(64) uint mask_ptr[1];
  alignas(64) float red_buf0_ptr[1];
  alignas(64) float t0_ptr_1[1];
  alignas(64) uint mask_ptr_1[1];
  alignas(64) float red_buf0_ptr_1[1];
  red_buf0_ptr[0] = in_thread_T_softmax_maxelem_shared_ptr[0];
  mask_ptr[0] = __activemask();
  t0_ptr[0] = __shfl_down_sync(mask_ptr[0], red_buf0_ptr[0], 16, 32);
  red_buf0_ptr[0] = max(red_buf0_ptr[0], t0_ptr[0]);
  t0_ptr[0] = __shfl_down_sync(mask_ptr[0], red_buf0_ptr[0], 8, 32);
  red_buf0_ptr[0] = max(red_buf0_ptr[0], t0_ptr[0]);
  t0_ptr[0] = __shfl_down_sync(mask_ptr[0], red_buf0_ptr[0], 4, 32);
  red_buf0_ptr[0] = max(red_buf0_ptr[0], t0_ptr[0]);
  t0_ptr[0] = __shfl_down_sync(mask_ptr[0], red_buf0_ptr[0], 2, 32);
  red_buf0_ptr[0] = max(red_buf0_ptr[0], t0_ptr[0]);
  t0_ptr[0] = __shfl_down_sync(mask_ptr[0], red_buf0_ptr[0], 1, 32);
  red_buf0_ptr[0] = max(red_buf0_ptr[0], t0_ptr[0]);
  if ((((int)threadIdx.x) % 32) == 0) {
    red_buf_staging_ptr[(((int)threadIdx.x) >> 5)] = red_buf0_ptr[0];
  }
  __syncthreads();
  if (((int)threadIdx.x) < 8) {
    red_buf0_ptr_1[0] = red_buf_staging_ptr[((int)threadIdx.x)];
  }
  mask_ptr_1[0] = __activemask();
  t0_ptr_1[0] = __shfl_down_sync(mask_ptr_1[0], red_buf0_ptr_1[0], 4, 32);
  red_buf0_ptr_1[0] = max(red_buf0_ptr_1[0], t0_ptr_1[0]);
  t0_ptr_1[0] = __shfl_down_sync(mask_ptr_1[0], red_buf0_ptr_1[0], 2, 32);
  red_buf0_ptr_1[0] = max(red_buf0_ptr_1[0], t0_ptr_1[0]);
  t0_ptr_1[0] = __shfl_down_sync(mask_ptr_1[0], red_buf0_ptr_1[0], 1, 32);
  red_buf0_ptr_1[0] = max(red_buf0_ptr_1[0], t0_ptr_1[0]);
  if (((int)threadIdx.x) == 0) {
    ((volatile float*)red_result_ptr)[0] = red_buf0_ptr_1[0];
  }
  __syncthreads();
  if (((int)threadIdx.x) == 0) {
    T_softmax_maxelem_shared_ptr[0] = ((volatile float*)red_result_ptr)[0];
  }
  in_thread_compute_shared_ptr[0] = 0x0p+0f/*0.000000e+00*/;
  __syncthreads();
  if (((int)threadIdx.x) < 10) {
    in_thread_compute_shared_ptr[0] = (in_thread_compute_shared_ptr[0] + expf((lv14_ptr[((int)threadIdx.x)] - T_softmax_maxelem_shared_ptr[0])));
  }
  __shared__ alignas(64) float red_buf_staging_ptr_1[8];
  alignas(64) float t0_ptr_2[1];
  alignas(64) uint mask_ptr_2[1];
  alignas(64) float red_buf0_ptr_2[1];
  alignas(64) float t0_ptr_3[1];
  alignas(64) uint mask_ptr_3[1];
  alignas(64) float red_buf0_ptr_3[1];
  red_buf0_ptr_2[0] = in_thread_compute_shared_ptr[0];
  mask_ptr_2[0] = __activemask();
  t0_ptr_2[0] = __shfl_down_sync(mask_ptr_2[0], red_buf0_ptr_2[0], 16, 32);
  red_buf0_ptr_2[0] = (red_buf0_ptr_2[0] + t0_ptr_2[0]);
  t0_ptr_2[0] = __shfl_down_sync(mask_ptr_2[0], red_buf0_ptr_2[0], 8, 32);
  red_buf0_ptr_2[0] = (red_buf0_ptr_2[0] + t0_ptr_2[0]);
  t0_ptr_2[0] = __shfl_down_sync(mask_ptr_2[0], red_buf0_ptr_2[0], 4, 32);
  red_buf0_ptr_2[0] = (red_buf0_ptr_2[0] + t0_ptr_2[0]);
  t0_ptr_2[0] = __shfl_down_sync(mask_ptr_2[0], red_buf0_ptr_2[0], 2, 32);
  red_buf0_ptr_2[0] = (red_buf0_ptr_2[0] + t0_ptr_2[0]);
  t0_ptr_2[0] = __shfl_down_sync(mask_ptr_2[0], red_buf0_ptr_2[0], 1, 32);
  red_buf0_ptr_2[0] = (red_buf0_ptr_2[0] + t0_ptr_2[0]);
  if ((((int)threadIdx.x) % 32) == 0) {
    red_buf_staging_ptr_1[(((int)threadIdx.x) >> 5)] = red_buf0_ptr_2[0];
  }
  __syncthreads();
  if (((int)threadIdx.x) < 8) {
    red_buf0_ptr_3[0] = red_buf_staging_ptr_1[((int)threadIdx.x)];
  }
  mask_ptr_3[0] = __activemask();
  t0_ptr_3[0] = __shfl_down_sync(mask_ptr_3[0], red_buf0_ptr_3[0], 4, 32);
  red_buf0_ptr_3[0] = (red_buf0_ptr_3[0] + t0_ptr_3[0]);
  t0_ptr_3[0] = __shfl_down_sync(mask_ptr_3[0], red_buf0_ptr_3[0], 2, 32);
  red_buf0_ptr_3[0] = (red_buf0_ptr_3[0] + t0_ptr_3[0]);
  t0_ptr_3[0] = __shfl_down_sync(mask_ptr_3[0], red_buf0_ptr_3[0], 1, 32);
  red_buf0_ptr_3[0] = (red_buf0_ptr_3[0] + t0_ptr_3[0]);
  if (((int)threadIdx.x) == 0) {
    ((volatile float*)red_result_ptr_1)[0] = red_buf0_ptr_3[0];
  }
  __syncthreads();
  if (((int)threadIdx.x) == 0) {
    compute_shared_ptr[0] = ((volatile float*)red_result_ptr_1)[0];
  }
  __syncthreads();
  if (((int)threadIdx.x) < 10) {
    compute_ptr[((int)threadIdx.x)] = ((lv14_ptr[((int)threadIdx.x)] - T_softmax_maxelem_shared_ptr[0]) - logf(compute_shared_ptr[0]));
  }
}

