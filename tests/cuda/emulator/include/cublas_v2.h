// Fake cuBLAS header of the CPU emulator: GemmEx / GemmStridedBatchedEx by their documented
// column-major definition, checking the leading dimensions as cuBLAS does.
#pragma once
#include "cuda_runtime.h"
enum cublasStatus_t {
  CUBLAS_STATUS_SUCCESS = 0,
  CUBLAS_STATUS_NOT_INITIALIZED = 1,
  CUBLAS_STATUS_ALLOC_FAILED = 3,
  CUBLAS_STATUS_INVALID_VALUE = 7,
  CUBLAS_STATUS_ARCH_MISMATCH = 8,
  CUBLAS_STATUS_MAPPING_ERROR = 11,
  CUBLAS_STATUS_EXECUTION_FAILED = 13,
  CUBLAS_STATUS_INTERNAL_ERROR = 14,
  CUBLAS_STATUS_NOT_SUPPORTED = 15,
  CUBLAS_STATUS_LICENSE_ERROR = 16
};
struct cublasContext;
typedef cublasContext* cublasHandle_t;
enum cublasOperation_t { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 };
enum cudaDataType_t { CUDA_R_32F = 0, CUDA_R_16BF = 14 };
enum cublasComputeType_t { CUBLAS_COMPUTE_32F = 68, CUBLAS_COMPUTE_32F_PEDANTIC = 69 };
enum cublasGemmAlgo_t { CUBLAS_GEMM_DEFAULT = -1 };
enum cublasMath_t {
  CUBLAS_DEFAULT_MATH = 0,
  CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION = 16
};
enum cublasPointerMode_t { CUBLAS_POINTER_MODE_HOST = 0 };
cublasStatus_t cublasCreate(cublasHandle_t* h);
cublasStatus_t cublasDestroy(cublasHandle_t h);
cublasStatus_t cublasSetStream(cublasHandle_t, cudaStream_t);
cublasStatus_t cublasSetPointerMode(cublasHandle_t, cublasPointerMode_t);
cublasStatus_t cublasSetMathMode(cublasHandle_t, cublasMath_t);
cublasStatus_t cublasSetWorkspace(cublasHandle_t, void*, size_t);
cublasStatus_t cublasGemmEx(cublasHandle_t, cublasOperation_t ta, cublasOperation_t tb, int m,
                            int n, int k, const void* alpha, const void* A, cudaDataType_t at,
                            int lda, const void* B, cudaDataType_t bt, int ldb, const void* beta,
                            void* C, cudaDataType_t ct, int ldc, cublasComputeType_t,
                            cublasGemmAlgo_t);
cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t, cublasOperation_t ta,
                                          cublasOperation_t tb, int m, int n, int k,
                                          const void* alpha, const void* A, cudaDataType_t at,
                                          int lda, long long sa, const void* B, cudaDataType_t bt,
                                          int ldb, long long sb, const void* beta, void* C,
                                          cudaDataType_t ct, int ldc, long long sc, int batch,
                                          cublasComputeType_t, cublasGemmAlgo_t);
