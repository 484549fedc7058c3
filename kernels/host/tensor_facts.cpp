// PyTorch tensors' metadata in one native pass (gpuflat/_src/tensor_facts.py).
//
// gpuflat.torch finds a call's leaf table again by each tensor's address,
// element count, dtype and contiguity. Read from Python, with a method call
// per tensor and per fact, that costs about 0.3 µs per tensor: 3 ms for
// 10,000 gradients, more than the kernels. Here the same facts, and the
// gradients of a list of parameters, are read through libtorch's C++ API
// (the library is loaded with ctypes.PyDLL, so the GIL is held throughout).
//
// An optimizer's step also proves, in one pass, that its parameter groups'
// lists still hold the parameters it found (gf_same_items), and reads the
// words of its state (gf_state_words) where that state was edited.
//
// Only plain tensors are read: exactly torch.Tensor or torch.nn.Parameter,
// strided, with storage. Anything else (a DTensor, a subclass that may
// override what Python sees, a sparse tensor) returns -1 and the caller reads
// the list in Python, where those cases are handled and named.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>

// The code word's parts, written from gpuflat/_src/tensor_facts.py.
#include "gpuflat_tensor_facts.h"

#define GF_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

PyTypeObject* g_tensor = nullptr;
PyTypeObject* g_parameter = nullptr;
// gpuflat's code of each c10::ScalarType: its position in the dtype list
// given at init (so the Python fallback computes the same codes), -1 if absent.
int64_t g_code[256];
// The rest of a tensor's code word (gpuflat/_src/tensor_facts.py): whether it is
// contiguous; whether it is a conjugate or negative view (its memory holds
// other values than it shows); its device's kind and index + 1.
constexpr int64_t CONTIGUOUS = GF_FACTS_CONTIGUOUS;
constexpr int64_t LAZY_VIEW = GF_FACTS_LAZY_VIEW;

int64_t device_code(const c10::Device& d) {
    const int64_t kind = d.is_cpu() ? GF_FACTS_CPU : d.is_cuda() ? GF_FACTS_CUDA : GF_FACTS_OTHER_DEVICE;
    return (kind | (int64_t(d.index() + 1) << GF_FACTS_INDEX_SHIFT)) << GF_FACTS_DEVICE_SHIFT;
}

bool plain(PyObject* obj) {
    return Py_TYPE(obj) == g_tensor || Py_TYPE(obj) == g_parameter;
}

// Writes the tensor's row (address, element count, code); false if it is
// not read here.
bool write_row(const at::Tensor& t, int64_t* row) {
    if (t.layout() != c10::kStrided || !t.has_storage()) return false;
    const int64_t code = g_code[static_cast<uint8_t>(t.scalar_type())];
    if (code < 0) return false;
    row[0] = reinterpret_cast<int64_t>(t.data_ptr());
    row[1] = t.numel();
    row[2] = code | (t.is_contiguous() ? CONTIGUOUS : 0) | (t.is_conj() || t.is_neg() ? LAZY_VIEW : 0) |
             device_code(t.device());
    return true;
}

}  // namespace

// dtypes: a list of torch.dtype; a dtype's code is its position in it.
GF_EXPORT void gf_tensor_facts_init(PyObject* tensor_type, PyObject* parameter_type, PyObject* dtypes) {
    g_tensor = reinterpret_cast<PyTypeObject*>(tensor_type);
    g_parameter = reinterpret_cast<PyTypeObject*>(parameter_type);
    for (int64_t& code : g_code) code = -1;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(dtypes); ++i) {
        auto* dtype = reinterpret_cast<THPDtype*>(PyList_GET_ITEM(dtypes, i));
        g_code[static_cast<uint8_t>(dtype->scalar_type)] = i;
    }
}

// objects: a list of tensors (grads = 0), or of parameters whose gradients
// are read (grads = 1: those without one are skipped, the others appended
// to `present`). rows: room for len(objects) rows of 3 words. Returns the
// number of rows written, or -1 where some object or gradient is not read
// here (then `present` is incomplete and must be dropped).
GF_EXPORT long long gf_tensor_facts(PyObject* objects, int grads, PyObject* present, int64_t* rows) {
    if (!PyList_Check(objects)) return -1;
    long long count = 0;
    try {
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(objects); ++i) {
            PyObject* obj = PyList_GET_ITEM(objects, i);
            if (!plain(obj)) return -1;
            const at::Tensor& tensor = THPVariable_Unpack(obj);
            if (grads) {
                // PyTorch warns when a non-leaf's .grad is read: let Python read it.
                if (!tensor.is_leaf() && !tensor.retains_grad()) return -1;
                const at::Tensor& grad = tensor.grad();
                if (!grad.defined()) continue;
                PyObject* wrapped = THPVariable_Wrap(grad);  // the gradient's own Python object
                if (wrapped == nullptr) {
                    PyErr_Clear();
                    return -1;
                }
                const bool kept = plain(wrapped) && PyList_Append(present, wrapped) == 0;
                Py_DECREF(wrapped);
                if (!kept) {
                    PyErr_Clear();
                    return -1;
                }
                if (!write_row(grad, rows + 3 * count)) return -1;
            } else if (!write_row(tensor, rows + 3 * count)) {
                return -1;
            }
            ++count;
        }
    } catch (...) {  // a tensor libtorch refuses to describe: read it in Python
        return -1;
    }
    return count;
}

// Whether the lists in `lists` hold, one after the other, exactly the objects
// of `flat` (by identity, never by value): 1 or 0.
GF_EXPORT long long gf_same_items(PyObject* lists, PyObject* flat) {
    if (!PyList_Check(lists) || !PyList_Check(flat)) return 0;
    const Py_ssize_t n = PyList_GET_SIZE(flat);
    Py_ssize_t j = 0;
    for (Py_ssize_t g = 0; g < PyList_GET_SIZE(lists); ++g) {
        PyObject* list = PyList_GET_ITEM(lists, g);
        if (!PyList_Check(list)) return 0;
        const Py_ssize_t m = PyList_GET_SIZE(list);
        if (j + m > n) return 0;
        for (Py_ssize_t i = 0; i < m; ++i) {
            if (PyList_GET_ITEM(list, i) != PyList_GET_ITEM(flat, j + i)) return 0;
        }
        j += m;
    }
    return j == n;
}

// The words of an optimizer's state dict (gpuflat/_src/param_rows.py): per
// entry, in the dict's order, the key's and its dict's identities, then per
// name of `names` the identity of the value under that name (0 where
// absent or None) and, for a plain strided tensor with storage, its data pointer
// (else 0). rows: room for `capacity` rows of 2 + 2 * len(names) words.
// Returns the number of entries, or -1 where an entry's value is not exactly
// a dict or its subclass, or there is not room (Python reads it then).
GF_EXPORT long long gf_state_words(PyObject* state, PyObject* names, int64_t* rows, long long capacity) {
    if (!PyDict_Check(state) || !PyTuple_Check(names)) return -1;
    const Py_ssize_t n_names = PyTuple_GET_SIZE(names);
    const Py_ssize_t width = 2 + 2 * n_names;
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    long long count = 0;
    try {
        while (PyDict_Next(state, &pos, &key, &value)) {
            if (count >= capacity || !PyDict_Check(value)) return -1;
            int64_t* row = rows + width * count;
            row[0] = reinterpret_cast<int64_t>(key);
            row[1] = reinterpret_cast<int64_t>(value);
            for (Py_ssize_t k = 0; k < n_names; ++k) {
                PyObject* item = PyDict_GetItemWithError(value, PyTuple_GET_ITEM(names, k));
                if (item == nullptr && PyErr_Occurred()) {
                    PyErr_Clear();
                    return -1;
                }
                if (item == Py_None) item = nullptr;
                row[2 + 2 * k] = reinterpret_cast<int64_t>(item);
                row[3 + 2 * k] = 0;
                if (item != nullptr && plain(item)) {
                    const at::Tensor& t = THPVariable_Unpack(item);
                    if (t.layout() == c10::kStrided && t.has_storage()) {
                        row[3 + 2 * k] = reinterpret_cast<int64_t>(t.data_ptr());
                    }
                }
            }
            ++count;
        }
    } catch (...) {
        return -1;
    }
    return count;
}
