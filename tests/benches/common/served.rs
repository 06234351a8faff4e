//! What the network benchmarks serve from the host's loopback: files of incompressible bytes, in server
//! directories removed when the benchmark ends.

use std::io::Write;
use std::path::{Path, PathBuf};

/// Server directories (outside every scratch), removed when dropped: they hold large files.
pub struct Removed(pub Vec<PathBuf>);

impl Drop for Removed {
    fn drop(&mut self) {
        for dir in &self.0 {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// `size` bytes of a fixed pseudo-random MiB, repeated (nothing on the path compresses).
pub fn write_file(path: &Path, size: usize) {
    let mut block = vec![0u8; 1 << 20];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for chunk in block.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes());
    }
    let mut file = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    for _ in 0..size / block.len() {
        file.write_all(&block).unwrap();
    }
    file.flush().unwrap();
}

/// curl's `-w '%{time_total} %{size_download}'` as MB/s, checking the size.
pub fn mb_per_s(line: &str, size: usize) -> f64 {
    let (secs, bytes) = line.split_once(' ').unwrap();
    let (secs, bytes) = (secs.parse::<f64>().unwrap(), bytes.trim().parse::<usize>().unwrap());
    assert_eq!(bytes, size, "the whole file arrived: {line:?}");
    size as f64 / secs / 1e6
}
