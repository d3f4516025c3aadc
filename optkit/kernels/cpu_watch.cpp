// Whether what a kept value was derived from still stands: models/derived.py's per-step check in C++
// loops. Built at first use by optkit/kernels/cpu_watch.py (a Python module, not an operator library:
// it reads Python objects).
//
// A fused CPU decode stack keeps its weights while every watched slot (a module's _parameters,
// _buffers or _modules dict entry) holds the same object, every watched tensor lies on the same
// storage at the same version, and no watched module has a forward hook. At batch 1 the check runs
// right after the step streamed 60-200 MB of weights through the caches, so each of its ~1,600
// Python and tensor objects is a cache miss, and each answer sits at the end of a chain of them
// (dict -> keys -> entry; tensor -> TensorImpl -> storage and version counter). Python's loops walk
// one chain after the other (~0.6 ms a step on a 30-layer model). Here every check walks its chains
// level by level: one pass prefetches the first object of every chain, the next pass the second, so
// hundreds of misses are in flight at once. The answers are those of the Python.

#include <torch/extension.h>

#include <cstdint>
#include <initializer_list>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

namespace py = pybind11;

inline void prefetch(const void* p, int lines = 1) {
#if defined(__x86_64__)
  for (int i = 0; i < lines; ++i) _mm_prefetch(static_cast<const char*>(p) + 64 * i, _MM_HINT_T0);
#endif
}

class Watch {
 public:
  // holders[i][names[i]] held held[i] (None: the name was absent); tensors: their data pointers are
  // watched; versioned: their versions too (inference tensors have none); modules: their forward
  // hooks and pre-hooks, read from the dicts torch's register_forward_hook and
  // register_forward_pre_hook add to (each module's own, made with it).
  Watch(const py::list& holders, const py::list& names, const py::list& held, const py::list& tensors,
        const py::list& versioned, const py::list& modules)
      : holders_(items(holders)), names_(items(names)), held_(items(held)), tensors_(items(tensors)),
        versioned_(items(versioned)) {
    TORCH_CHECK(holders_.size() == names_.size() && names_.size() == held_.size(),
                "Watch: one name and object a holder");
    for (const py::object& h : holders_) TORCH_CHECK(PyDict_Check(h.ptr()), "Watch: holders are dicts");
    for (const py::object& n : names_) TORCH_CHECK(PyUnicode_CheckExact(n.ptr()), "Watch: names are str");
    for (const std::vector<py::object>* list : {&tensors_, &versioned_})
      for (const py::object& t : *list) TORCH_CHECK(THPVariable_Check(t.ptr()), "Watch: tensors are tensors");
    // a tensor object keeps its TensorImpl for life (`.data =` swaps the storage inside it)
    for (const py::object& t : tensors_) tensor_impls_.push_back(THPVariable_Unpack(t.ptr()).unsafeGetTensorImpl());
    for (const py::object& t : versioned_)
      versioned_impls_.push_back(THPVariable_Unpack(t.ptr()).unsafeGetTensorImpl());
    for (c10::TensorImpl* impl : tensor_impls_) data_ptrs_.push_back(impl->data());
    for (c10::TensorImpl* impl : versioned_impls_) versions_.push_back(impl->version_counter().current_version());
    for (const py::handle& m : modules)
      for (const char* name : {"_forward_hooks", "_forward_pre_hooks"}) {
        py::object hooks = m.attr(name);
        TORCH_CHECK(PyDict_Check(hooks.ptr()), "Watch: a module's ", name, " is a dict");
        hook_dicts_.push_back(hooks);
      }
  }

  // Every slot holds its object, on the same storage, at the same version (the GIL held: a call from Python)
  bool stands() const {
    for (const py::object& h : holders_) prefetch(h.ptr());
    for (const py::object& h : holders_) prefetch(reinterpret_cast<PyDictObject*>(h.ptr())->ma_keys, 3);
    for (c10::TensorImpl* impl : tensor_impls_) prefetch(impl, 4);  // the versioned ones are among them
    for (c10::TensorImpl* impl : tensor_impls_) prefetch(impl->storage().unsafeGetStorageImpl(), 2);
    for (size_t i = 0; i < holders_.size(); ++i) {
      PyObject* now = PyDict_GetItemWithError(holders_[i].ptr(), names_[i].ptr());  // borrowed; str keys: no error
      if ((now == nullptr ? Py_None : now) != held_[i].ptr()) return false;
    }
    for (size_t i = 0; i < tensor_impls_.size(); ++i)
      if (tensor_impls_[i]->data() != data_ptrs_[i]) return false;
    for (size_t i = 0; i < versioned_impls_.size(); ++i)
      if (versioned_impls_[i]->version_counter().current_version() != versions_[i]) return false;
    return true;
  }

  // Whether any watched module has a forward hook or pre-hook (its own; torch's global hooks are the
  // caller's to check)
  bool hooked() const {
    for (const py::object& d : hook_dicts_) prefetch(d.ptr());
    for (const py::object& d : hook_dicts_)
      if (PyDict_GET_SIZE(d.ptr()) != 0) return true;
    return false;
  }

 private:
  static std::vector<py::object> items(const py::list& list) {
    std::vector<py::object> out;
    out.reserve(list.size());
    for (const py::handle& item : list) out.push_back(py::reinterpret_borrow<py::object>(item));
    return out;
  }

  std::vector<py::object> holders_, names_, held_, tensors_, versioned_, hook_dicts_;
  std::vector<c10::TensorImpl*> tensor_impls_, versioned_impls_;  // alive while tensors_ and versioned_ are
  std::vector<const void*> data_ptrs_;
  std::vector<int64_t> versions_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Watch>(m, "Watch")
      .def(py::init<const py::list&, const py::list&, const py::list&, const py::list&, const py::list&,
                    const py::list&>())
      .def("stands", &Watch::stands)
      .def("hooked", &Watch::hooked);
}
