/// Each module as a fat binary (mold's patch: machine code for every architecture in
/// MOLD_CUDA_ARCHS, PTX of the newest), 8-byte aligned as the driver reads it.
mod fatbin {
    #[repr(C, align(8))]
    pub struct Aligned<B: ?Sized>(pub B);

    macro_rules! fatbin {
        ($cst:ident, $file:literal) => {
            pub const $cst: &[u8] = {
                static A: &Aligned<[u8]> =
                    &Aligned(*include_bytes!(concat!(env!("OUT_DIR"), "/", $file)));
                &A.0
            };
        };
    }
    fatbin!(AFFINE, "affine.fatbin");
    fatbin!(BINARY, "binary.fatbin");
    fatbin!(CAST, "cast.fatbin");
    fatbin!(CONV, "conv.fatbin");
    fatbin!(FILL, "fill.fatbin");
    fatbin!(INDEXING, "indexing.fatbin");
    fatbin!(QUANTIZED, "quantized.fatbin");
    fatbin!(REDUCE, "reduce.fatbin");
    fatbin!(SORT, "sort.fatbin");
    fatbin!(TERNARY, "ternary.fatbin");
    fatbin!(UNARY, "unary.fatbin");
}

#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Id {
    Affine,
    Binary,
    Cast,
    Conv,
    Fill,
    Indexing,
    Quantized,
    Reduce,
    Sort,
    Ternary,
    Unary,
}

pub const ALL_IDS: [Id; 11] = [
    Id::Affine,
    Id::Binary,
    Id::Cast,
    Id::Conv,
    Id::Fill,
    Id::Indexing,
    Id::Quantized,
    Id::Reduce,
    Id::Sort,
    Id::Ternary,
    Id::Unary,
];

pub struct Module {
    index: usize,
    fatbin: &'static [u8],
}

impl Module {
    pub fn index(&self) -> usize {
        self.index
    }

    /// The module's fat binary (`cuModuleLoadData` takes it as it is).
    pub fn fatbin(&self) -> &'static [u8] {
        self.fatbin
    }
}

const fn module_index(id: Id) -> usize {
    let mut i = 0;
    while i < ALL_IDS.len() {
        if ALL_IDS[i] as u32 == id as u32 {
            return i;
        }
        i += 1;
    }
    panic!("id not found")
}

macro_rules! mdl {
    ($cst:ident, $id:ident) => {
        pub const $cst: Module = Module {
            index: module_index(Id::$id),
            fatbin: fatbin::$cst,
        };
    };
}

mdl!(AFFINE, Affine);
mdl!(BINARY, Binary);
mdl!(CAST, Cast);
mdl!(CONV, Conv);
mdl!(FILL, Fill);
mdl!(INDEXING, Indexing);
mdl!(QUANTIZED, Quantized);
mdl!(REDUCE, Reduce);
mdl!(SORT, Sort);
mdl!(TERNARY, Ternary);
mdl!(UNARY, Unary);

pub mod ffi;
