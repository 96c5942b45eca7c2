// The few BLAS/LAPACK routines the readout uses, from OpenBLAS (Debian's
// libopenblas-dev ships both, with CBLAS). Fortran LAPACK symbols are
// declared here because Debian ships no LAPACKE header with OpenBLAS.
#ifndef LEAP_READOUT_INTERNAL_BLAS_H_
#define LEAP_READOUT_INTERNAL_BLAS_H_

#include <cblas.h>

extern "C" {
void dpotrf_(const char* uplo, const int* n, double* a, const int* lda,
             int* info);
void dpotri_(const char* uplo, const int* n, double* a, const int* lda,
             int* info);
void dtrtri_(const char* uplo, const char* diag, const int* n, double* a,
             const int* lda, int* info);
void dpotrs_(const char* uplo, const int* n, const int* nrhs, const double* a,
             const int* lda, double* b, const int* ldb, int* info);
}

#endif  // LEAP_READOUT_INTERNAL_BLAS_H_
