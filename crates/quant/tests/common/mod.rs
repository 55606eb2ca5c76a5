//! Reading the fixture safetensors in tests.
#![allow(dead_code)]

use half::{bf16, f16};
use rtune_quant::RawTensor;
use safetensors::{Dtype, SafeTensors};
use std::path::PathBuf;

pub fn fixture(rel: &str) -> Vec<u8> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(rel);
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

pub struct St<'a>(pub SafeTensors<'a>);

impl<'a> St<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        St(SafeTensors::deserialize(bytes).expect("fixture is safetensors"))
    }
    pub fn has(&self, k: &str) -> bool {
        self.0.tensor(k).is_ok()
    }
    pub fn raw(&self, k: &str) -> Option<RawTensor<'a>> {
        self.0.tensor(k).ok().map(|v| RawTensor::from_view(&v))
    }
    /// Any float tensor as f32 (bf16/f16 upcasts are exact).
    pub fn f32s(&self, k: &str) -> Vec<f32> {
        let v = self.0.tensor(k).unwrap_or_else(|_| panic!("no tensor {k}"));
        let d = v.data();
        match v.dtype() {
            Dtype::F32 => d
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect(),
            Dtype::BF16 => d
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes(b.try_into().unwrap()).to_f32())
                .collect(),
            Dtype::F16 => d
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes(b.try_into().unwrap()).to_f32())
                .collect(),
            t => panic!("{k} is {t:?}"),
        }
    }
    pub fn u8s(&self, k: &str) -> Vec<u8> {
        let v = self.0.tensor(k).unwrap_or_else(|_| panic!("no tensor {k}"));
        assert_eq!(v.dtype(), Dtype::U8, "{k}");
        v.data().to_vec()
    }
    pub fn shape(&self, k: &str) -> Vec<usize> {
        self.0.tensor(k).unwrap().shape().to_vec()
    }
    pub fn dtype(&self, k: &str) -> Dtype {
        self.0.tensor(k).unwrap().dtype()
    }
}

/// Bit-exact comparison of f32 slices, with the first differing index in the message.
pub fn assert_bits_eq(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!(
            "{what}: element {i} of {}: got {:e} ({:#010x}), want {:e} ({:#010x})",
            got.len(),
            got[i],
            got[i].to_bits(),
            want[i],
            want[i].to_bits()
        );
    }
}

pub fn assert_bytes_eq(what: &str, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        panic!(
            "{what}: byte {i} of {}: got {:#04x}, want {:#04x}",
            got.len(),
            got[i],
            want[i]
        );
    }
}

/// Rounds each value to bf16 and back (the dequantized output of a bf16 weight, stored upcast).
pub fn via_bf16(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
}
