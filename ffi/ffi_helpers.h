// Shared helpers of the Echo XLA FFI handlers: type aliases, attribute getters whose errors say
// what to fix, and error construction (in the style of TransformerEngine's JAX extension).
#ifndef ECHO_JAX_FFI_FFI_HELPERS_H_
#define ECHO_JAX_FFI_FFI_HELPERS_H_

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace echo {

namespace ffi = ::xla::ffi;

using Buffer_Type = ffi::AnyBuffer;
using Result_Type = ffi::Result<ffi::AnyBuffer>;
using Error_Type = ffi::Error;
using Dictionary_Type = ffi::Dictionary;
using FFI = ffi::Ffi;

// The typed buffers the Echo handlers take: flat fp32 data and small int32 coordinates.
using F32Buffer_Type = ffi::Buffer<ffi::F32, 1>;
using F32Result_Type = ffi::ResultBuffer<ffi::F32, 1>;
using S32Buffer_Type = ffi::Buffer<ffi::S32, 1>;

// Appends one piece of a message as an ostream would print it (numbers with the default
// format: integers in decimal, floating-point numbers as %g), without a stream: an ostream
// insertion inside a handler of the CUDA module crashed (the libstdc++ locale state of the
// loaded module), and the CUDA handlers share these errors.
template <typename T>
void StrAppend(std::string& out, const T& v) {
  using U = std::decay_t<T>;
  if constexpr (std::is_convertible_v<const T&, std::string_view>) {
    out += std::string_view(v);
  } else if constexpr (std::is_same_v<U, char>) {
    out += v;
  } else if constexpr (std::is_same_v<U, bool>) {
    out += v ? '1' : '0';
  } else if constexpr (std::is_integral_v<U>) {
    out += std::to_string(v);
  } else if constexpr (std::is_floating_point_v<U>) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(v));
    out += buf;
  } else {
    static_assert(std::is_enum_v<U>, "StrCat takes strings, characters, numbers and enums");
    out += std::to_string(static_cast<std::underlying_type_t<U>>(v));
  }
}

// Concatenates strings and numbers (StrAppend).
template <typename... Args>
std::string StrCat(const Args&... args) {
  std::string out;
  (StrAppend(out, args), ...);
  return out;
}

// Errors are prefixed with the handler name so that the Python exception says where it came from.
template <typename... Args>
Error_Type InvalidArgument(std::string_view where, Args&&... args) {
  return Error_Type(ffi::ErrorCode::kInvalidArgument,
                    StrCat("echo_jax ", where, ": ", std::forward<Args>(args)...));
}

template <typename... Args>
Error_Type DeadlineExceeded(std::string_view where, Args&&... args) {
  return Error_Type(ffi::ErrorCode::kDeadlineExceeded,
                    StrCat("echo_jax ", where, ": ", std::forward<Args>(args)...));
}

template <typename... Args>
Error_Type Aborted(std::string_view where, Args&&... args) {
  return Error_Type(ffi::ErrorCode::kAborted,
                    StrCat("echo_jax ", where, ": ", std::forward<Args>(args)...));
}

template <typename... Args>
Error_Type Internal(std::string_view where, Args&&... args) {
  return Error_Type(ffi::ErrorCode::kInternal,
                    StrCat("echo_jax ", where, ": ", std::forward<Args>(args)...));
}

// Returns an InvalidArgument error from the enclosing handler when `cond` does not hold.
#define ECHO_FFI_CHECK(cond, where, ...)                         \
  do {                                                           \
    if (!(cond)) return ::echo::InvalidArgument(where, __VA_ARGS__); \
  } while (0)

// Propagates a failed ffi::Error.
#define ECHO_FFI_RETURN_IF_ERROR(expr)                  \
  do {                                                  \
    ::echo::Error_Type echo_ffi_err_ = (expr);      \
    if (echo_ffi_err_.failure()) return echo_ffi_err_;  \
  } while (0)

#define ECHO_FFI_CONCAT_INNER_(a, b) a##b
#define ECHO_FFI_CONCAT_(a, b) ECHO_FFI_CONCAT_INNER_(a, b)

// `lhs = *expr` for an ffi::ErrorOr expression, or returns its error.
#define ECHO_FFI_ASSIGN_OR_RETURN(lhs, expr) \
  ECHO_FFI_ASSIGN_OR_RETURN_IMPL_(ECHO_FFI_CONCAT_(echo_ffi_or_, __LINE__), lhs, expr)
#define ECHO_FFI_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                    \
  if (tmp.has_error()) return std::move(tmp.error());   \
  lhs = std::move(tmp.value())

template <typename T>
struct AttrTypeName;
template <>
struct AttrTypeName<int64_t> {
  static constexpr const char* value = "an int64 (a Python int)";
};
template <>
struct AttrTypeName<int32_t> {
  static constexpr const char* value = "an int32 (np.int32)";
};
template <>
struct AttrTypeName<float> {
  static constexpr const char* value = "a float32 (np.float32)";
};
template <>
struct AttrTypeName<double> {
  static constexpr const char* value = "a float64 (np.float64)";
};
template <>
struct AttrTypeName<bool> {
  static constexpr const char* value = "a bool";
};
template <>
struct AttrTypeName<std::string_view> {
  static constexpr const char* value = "a string (a Python str)";
};
template <>
struct AttrTypeName<ffi::Span<const int64_t>> {
  static constexpr const char* value = "an int64 array (np.int64)";
};

// Whether the FFI can test an attribute's type before decoding it (scalars and strings can).
template <typename T, typename = void>
struct HasAttrIsa : std::false_type {};
template <typename T>
struct HasAttrIsa<T, std::void_t<decltype(ffi::AttrDecoding<T>::Isa(XLA_FFI_AttrType{}, nullptr))>>
    : std::true_type {};

// Reads attribute `name` of type T, with an error that names the attribute, the expected type
// and what to do about it (the attributes are written by echo_jax/transports; a mismatch means the
// Python package and the compiled extensions come from different versions).
template <typename T>
ffi::ErrorOr<T> GetAttr(const Dictionary_Type& attrs, std::string_view name,
                        std::string_view where) {
  if (!attrs.contains(name)) {
    return InvalidArgument(where, "missing attribute '", name, "' (", AttrTypeName<T>::value,
                           "); echo_jax/transports passes it, so the Python package and the "
                           "compiled extensions (echo_jax._ffi, echo_jax._ffi_cuda) are out of "
                           "sync: reinstall with `pip install -e .`");
  }
  if constexpr (HasAttrIsa<T>::value) {  // arrays have no type test: get's error says it
    if (!attrs.contains<T>(name)) {
      return InvalidArgument(where, "attribute '", name, "' must be ", AttrTypeName<T>::value);
    }
  }
  ffi::ErrorOr<T> value = attrs.get<T>(name);
  if (value.has_error()) {
    return InvalidArgument(where, "attribute '", name, "': ", value.error().message());
  }
  return value.value();
}

// The closed range check [lo, hi] of an attribute's value; `what` says what it means.
template <typename T>
Error_Type CheckAttrInRange(T value, std::string_view name, T lo, T hi, std::string_view where,
                            std::string_view what) {
  if (value < lo || value > hi) {
    return InvalidArgument(where, "attribute '", name, "' (", what, ") must be in [", lo, ", ", hi,
                           "], got ", value);
  }
  return Error_Type::Success();
}

// GetAttr plus CheckAttrInRange.
template <typename T>
ffi::ErrorOr<T> GetAttrInRange(const Dictionary_Type& attrs, std::string_view name, T lo, T hi,
                               std::string_view where, std::string_view what) {
  ECHO_FFI_ASSIGN_OR_RETURN(T value, GetAttr<T>(attrs, name, where));
  ECHO_FFI_RETURN_IF_ERROR(CheckAttrInRange<T>(value, name, lo, hi, where, what));
  return value;
}

}  // namespace echo

#endif  // ECHO_JAX_FFI_FFI_HELPERS_H_
