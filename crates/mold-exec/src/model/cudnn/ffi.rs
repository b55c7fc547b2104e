//! The slice of cuDNN's backend (graph) API that attention and convolution need, loaded at
//! run time.
//!
//! libcudnn is opened with `dlopen` on first use (`libcudnn.so.9`, as PyTorch's wheels and
//! NVIDIA's packages install it), never linked: a machine without cuDNN runs mold's own
//! attention kernel instead. The numeric values below are cuDNN 9's (`cudnn_backend.h`;
//! the backend API keeps them stable across 9.x).

use libloading::Library;
use std::ffi::{c_char, c_void, CStr};
use std::sync::OnceLock;

pub type Status = i32;
pub type Desc = *mut c_void;
pub type Handle = *mut c_void;

pub const STATUS_SUCCESS: Status = 0;

// cudnnBackendDescriptorType_t
pub const POINTWISE_DESCRIPTOR: i32 = 0;
pub const CONVOLUTION_DESCRIPTOR: i32 = 1;
pub const ENGINE_DESCRIPTOR: i32 = 2;
pub const ENGINECFG_DESCRIPTOR: i32 = 3;
pub const ENGINEHEUR_DESCRIPTOR: i32 = 4;
pub const EXECUTION_PLAN_DESCRIPTOR: i32 = 5;
pub const OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR: i32 = 10;
pub const OPERATION_POINTWISE_DESCRIPTOR: i32 = 13;
pub const OPERATIONGRAPH_DESCRIPTOR: i32 = 15;
pub const VARIANT_PACK_DESCRIPTOR: i32 = 16;
pub const TENSOR_DESCRIPTOR: i32 = 17;
pub const MATMUL_DESCRIPTOR: i32 = 18;
pub const OPERATION_MATMUL_DESCRIPTOR: i32 = 19;
pub const REDUCTION_DESCRIPTOR: i32 = 21;
pub const OPERATION_REDUCTION_DESCRIPTOR: i32 = 22;
pub const OPERATION_SDPA_FWD_DESCRIPTOR: i32 = 41;

// cudnnBackendAttributeType_t
pub const TYPE_HANDLE: i32 = 0;
pub const TYPE_DATA_TYPE: i32 = 1;
pub const TYPE_BOOLEAN: i32 = 2;
pub const TYPE_INT64: i32 = 3;
pub const TYPE_FLOAT: i32 = 4;
pub const TYPE_VOID_PTR: i32 = 6;
pub const TYPE_CONVOLUTION_MODE: i32 = 7;
pub const TYPE_HEUR_MODE: i32 = 8;
pub const TYPE_POINTWISE_MODE: i32 = 14;
pub const TYPE_BACKEND_DESCRIPTOR: i32 = 15;
pub const TYPE_REDUCTION_OPERATOR_TYPE: i32 = 18;
pub const TYPE_BEHAVIOR_NOTE: i32 = 19;
pub const TYPE_CHAR: i32 = 24;

// cudnnBackendAttributeName_t
pub const ATTR_POINTWISE_MODE: i32 = 0;
pub const ATTR_POINTWISE_MATH_PREC: i32 = 1;
pub const ATTR_CONVOLUTION_COMP_TYPE: i32 = 100;
pub const ATTR_CONVOLUTION_CONV_MODE: i32 = 101;
pub const ATTR_CONVOLUTION_DILATIONS: i32 = 102;
pub const ATTR_CONVOLUTION_FILTER_STRIDES: i32 = 103;
pub const ATTR_CONVOLUTION_POST_PADDINGS: i32 = 104;
pub const ATTR_CONVOLUTION_PRE_PADDINGS: i32 = 105;
pub const ATTR_CONVOLUTION_SPATIAL_DIMS: i32 = 106;
pub const ATTR_ENGINEHEUR_MODE: i32 = 200;
pub const ATTR_ENGINEHEUR_OPERATION_GRAPH: i32 = 201;
pub const ATTR_ENGINEHEUR_RESULTS: i32 = 202;
pub const ATTR_ENGINECFG_ENGINE: i32 = 300;
pub const ATTR_EXECUTION_PLAN_HANDLE: i32 = 400;
pub const ATTR_EXECUTION_PLAN_ENGINE_CONFIG: i32 = 401;
pub const ATTR_EXECUTION_PLAN_WORKSPACE_SIZE: i32 = 402;
pub const ATTR_EXECUTION_PLAN_JSON_REPRESENTATION: i32 = 405;
pub const ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA: i32 = 700;
pub const ATTR_OPERATION_CONVOLUTION_FORWARD_BETA: i32 = 701;
pub const ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC: i32 = 702;
pub const ATTR_OPERATION_CONVOLUTION_FORWARD_W: i32 = 703;
pub const ATTR_OPERATION_CONVOLUTION_FORWARD_X: i32 = 704;
pub const ATTR_OPERATION_CONVOLUTION_FORWARD_Y: i32 = 705;
pub const ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR: i32 = 750;
pub const ATTR_OPERATION_POINTWISE_XDESC: i32 = 751;
pub const ATTR_OPERATION_POINTWISE_BDESC: i32 = 752;
pub const ATTR_OPERATION_POINTWISE_YDESC: i32 = 753;
pub const ATTR_OPERATIONGRAPH_HANDLE: i32 = 800;
pub const ATTR_OPERATIONGRAPH_OPS: i32 = 801;
pub const ATTR_TENSOR_BYTE_ALIGNMENT: i32 = 900;
pub const ATTR_TENSOR_DATA_TYPE: i32 = 901;
pub const ATTR_TENSOR_DIMENSIONS: i32 = 902;
pub const ATTR_TENSOR_STRIDES: i32 = 903;
pub const ATTR_TENSOR_UNIQUE_ID: i32 = 906;
pub const ATTR_TENSOR_IS_VIRTUAL: i32 = 907;
pub const ATTR_TENSOR_IS_BY_VALUE: i32 = 908;
pub const ATTR_VARIANT_PACK_UNIQUE_IDS: i32 = 1000;
pub const ATTR_VARIANT_PACK_DATA_POINTERS: i32 = 1001;
pub const ATTR_VARIANT_PACK_WORKSPACE: i32 = 1003;
pub const ATTR_ENGINE_BEHAVIOR_NOTE: i32 = 1305;
pub const ATTR_MATMUL_COMP_TYPE: i32 = 1500;
pub const ATTR_OPERATION_MATMUL_ADESC: i32 = 1520;
pub const ATTR_OPERATION_MATMUL_BDESC: i32 = 1521;
pub const ATTR_OPERATION_MATMUL_CDESC: i32 = 1522;
pub const ATTR_OPERATION_MATMUL_DESC: i32 = 1523;
pub const ATTR_REDUCTION_OPERATOR: i32 = 1600;
pub const ATTR_REDUCTION_COMP_TYPE: i32 = 1601;
pub const ATTR_OPERATION_REDUCTION_XDESC: i32 = 1610;
pub const ATTR_OPERATION_REDUCTION_YDESC: i32 = 1611;
pub const ATTR_OPERATION_REDUCTION_DESC: i32 = 1612;
pub const ATTR_OPERATION_SDPA_FWD_QDESC: i32 = 2800;
pub const ATTR_OPERATION_SDPA_FWD_KDESC: i32 = 2801;
pub const ATTR_OPERATION_SDPA_FWD_VDESC: i32 = 2802;
pub const ATTR_OPERATION_SDPA_FWD_ODESC: i32 = 2803;
pub const ATTR_OPERATION_SDPA_FWD_SCALEDESC: i32 = 2805;

// cudnnDataType_t
pub const DATA_FLOAT: i32 = 0;
pub const DATA_HALF: i32 = 2;
pub const DATA_BFLOAT16: i32 = 9;
pub const DATA_FP8_E4M3: i32 = 12;

// cudnnBackendBehaviorNote_t
pub const BEHAVIOR_NOTE_RUNTIME_COMPILATION: i32 = 0;

// cudnnBackendHeurMode_t
pub const HEUR_MODE_FALLBACK: i32 = 2;
pub const HEUR_MODE_A: i32 = 3;

// cudnnPointwiseMode_t
pub const POINTWISE_ADD: i32 = 0;
pub const POINTWISE_MUL: i32 = 1;
pub const POINTWISE_DIV: i32 = 6;
pub const POINTWISE_SUB: i32 = 9;
pub const POINTWISE_EXP: i32 = 13;
pub const POINTWISE_LOG: i32 = 15;

// cudnnConvolutionMode_t
pub const CROSS_CORRELATION: i32 = 1;

// cudnnReduceTensorOp_t
pub const REDUCE_ADD: i32 = 0;
pub const REDUCE_MAX: i32 = 3;
pub const REDUCE_AMAX: i32 = 4;

type FnCreateDesc = unsafe extern "C" fn(i32, *mut Desc) -> Status;
type FnDesc = unsafe extern "C" fn(Desc) -> Status;
type FnSetAttr = unsafe extern "C" fn(Desc, i32, i32, i64, *const c_void) -> Status;
type FnGetAttr = unsafe extern "C" fn(Desc, i32, i32, i64, *mut i64, *mut c_void) -> Status;
type FnExecute = unsafe extern "C" fn(Handle, Desc, Desc) -> Status;
type FnCreate = unsafe extern "C" fn(*mut Handle) -> Status;
type FnSetStream = unsafe extern "C" fn(Handle, *mut c_void) -> Status;
type FnVersion = unsafe extern "C" fn() -> usize;
type FnErrorString = unsafe extern "C" fn(Status) -> *const c_char;
type FnLastError = unsafe extern "C" fn(*mut c_char, usize);

/// The loaded library's entry points.
pub struct Api {
    _lib: Library,
    pub create_descriptor: FnCreateDesc,
    pub destroy_descriptor: FnDesc,
    pub finalize: FnDesc,
    pub set_attribute: FnSetAttr,
    pub get_attribute: FnGetAttr,
    pub execute: FnExecute,
    pub create: FnCreate,
    pub set_stream: FnSetStream,
    pub version: usize,
    error_string: FnErrorString,
    last_error: Option<FnLastError>,
}

// SAFETY: function pointers into a library that stays loaded for the process' life; cuDNN's
// backend calls are thread-safe apart from a handle, which callers serialise.
unsafe impl Send for Api {}
unsafe impl Sync for Api {}

/// Names tried in order.
const NAMES: [&str; 2] = ["libcudnn.so.9", "libcudnn.so"];

fn open() -> Result<Api, String> {
    let mut errors = Vec::new();
    for name in NAMES {
        // SAFETY: loading cuDNN runs its initialisers, which only register its engines.
        match unsafe { Library::new(name) } {
            Ok(lib) => return bind(lib),
            Err(e) => errors.push(format!("{name}: {e}")),
        }
    }
    Err(format!(
        "libcudnn not found ({}); install cuDNN 9 (e.g. the nvidia-cudnn wheel) and put its lib/ on LD_LIBRARY_PATH",
        errors.join("; ")
    ))
}

fn bind(lib: Library) -> Result<Api, String> {
    // SAFETY: the symbol types are cuDNN 9's C signatures.
    unsafe {
        macro_rules! sym {
            ($name:literal) => {
                *lib.get(concat!($name, "\0").as_bytes())
                    .map_err(|e| format!("libcudnn lacks {}: {e}", $name))?
            };
        }
        let version: FnVersion = sym!("cudnnGetVersion");
        let version = version();
        if version < 90000 {
            return Err(format!(
                "libcudnn is version {version}; mold's attention and convolutions need cuDNN 9"
            ));
        }
        let last_error = lib
            .get::<FnLastError>(b"cudnnGetLastErrorString\0")
            .ok()
            .map(|s| *s);
        Ok(Api {
            create_descriptor: sym!("cudnnBackendCreateDescriptor"),
            destroy_descriptor: sym!("cudnnBackendDestroyDescriptor"),
            finalize: sym!("cudnnBackendFinalize"),
            set_attribute: sym!("cudnnBackendSetAttribute"),
            get_attribute: sym!("cudnnBackendGetAttribute"),
            execute: sym!("cudnnBackendExecute"),
            create: sym!("cudnnCreate"),
            set_stream: sym!("cudnnSetStream"),
            error_string: sym!("cudnnGetErrorString"),
            last_error,
            version,
            _lib: lib,
        })
    }
}

/// cuDNN, loaded once per process; the error says why not.
pub fn api() -> Result<&'static Api, String> {
    static API: OnceLock<Result<Api, String>> = OnceLock::new();
    API.get_or_init(open).as_ref().map_err(|e| e.clone())
}

impl Api {
    /// `what` failed with `status`: cuDNN's name for it and its last message.
    pub fn error(&self, what: &str, status: Status) -> String {
        // SAFETY: cudnnGetErrorString returns a static C string.
        let name = unsafe { CStr::from_ptr((self.error_string)(status)) }
            .to_string_lossy()
            .into_owned();
        let mut detail = String::new();
        if let Some(f) = self.last_error {
            let mut buf = vec![0 as c_char; 512];
            // SAFETY: the buffer is as long as we say.
            unsafe { f(buf.as_mut_ptr(), buf.len()) };
            // SAFETY: cuDNN NUL-terminates within max_size.
            detail = unsafe { CStr::from_ptr(buf.as_ptr()) }
                .to_string_lossy()
                .trim()
                .to_string();
        }
        if detail.is_empty() {
            format!("{what}: {name}")
        } else {
            format!("{what}: {name} ({detail})")
        }
    }

    /// cuDNN's version as `major.minor.patch`.
    pub fn version_string(&self) -> String {
        let v = self.version;
        format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100)
    }
}
