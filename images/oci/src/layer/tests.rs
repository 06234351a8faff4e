use std::io::Write;

use super::*;
use crate::unpack::tree::{Limits, Spool, Tree};

#[derive(Default)]
struct Sink;

impl Spool for Sink {
    fn put(&mut self, _id: u64, data: &mut dyn Read, _size: u64) -> io::Result<()> {
        io::copy(data, &mut io::sink()).map(drop)
    }
}

fn tar_of(files: &[(&str, &[u8])]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (name, data) in files {
        let mut h = tar::Header::new_gnu();
        h.set_path(name).unwrap();
        h.set_mode(0o644);
        h.set_uid(0);
        h.set_gid(0);
        h.set_size(data.len() as u64);
        h.set_cksum();
        b.append(&h, *data).unwrap();
    }
    b.into_inner().unwrap()
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

/// Applies `blob` (compressed as `compression`) as one layer whose diff id is `diff_id`.
fn apply(blob: &[u8], compression: Compression, diff_id: Digest, limit: u64) -> io::Result<()> {
    let path =
        std::env::temp_dir().join(format!("vm-oci-layer-{}-{:?}", std::process::id(), std::thread::current().id()));
    std::fs::write(&path, blob).unwrap();
    let layer = Layer { digest: Digest::of(blob), size: blob.len() as u64, compression, diff_id };
    let result = (|| {
        let mut stream = open(&path, &layer, limit)?;
        Tree::new(Limits::default()).apply(&mut stream, &mut Sink).map_err(io::Error::other)?;
        stream.finish()
    })();
    let _ = std::fs::remove_file(&path);
    result
}

#[test]
fn each_compression_unpacks_and_its_diff_id_is_checked() {
    let tar = tar_of(&[("a", b"alpha"), ("b/c", &[7u8; 3000])]);
    let diff_id = Digest::of(&tar);
    let zstd = ruzstd::encoding::compress_to_vec(tar.as_slice(), ruzstd::encoding::CompressionLevel::Fastest);
    for (blob, compression) in
        [(tar.clone(), Compression::None), (gzip(&tar), Compression::Gzip), (zstd, Compression::Zstd)]
    {
        apply(&blob, compression, diff_id.clone(), 1 << 20).unwrap();
        let err = apply(&blob, compression, Digest::of(b"another layer"), 1 << 20).unwrap_err();
        assert!(err.to_string().contains("digest mismatch"), "{compression:?}: {err}");
    }
}

#[test]
fn two_zstd_frames_and_a_skippable_one_make_one_stream() {
    let tar = tar_of(&[("a", &[1u8; 5000]), ("b", b"bee")]);
    let (first, second) = tar.split_at(2048);
    let mut blob = ruzstd::encoding::compress_to_vec(first, ruzstd::encoding::CompressionLevel::Fastest);
    // A skippable frame: magic 0x184D2A50, a length, that many bytes.
    blob.extend_from_slice(&0x184D_2A50u32.to_le_bytes());
    blob.extend_from_slice(&3u32.to_le_bytes());
    blob.extend_from_slice(b"xyz");
    blob.extend(ruzstd::encoding::compress_to_vec(second, ruzstd::encoding::CompressionLevel::Fastest));
    apply(&blob, Compression::Zstd, Digest::of(&tar), 1 << 20).unwrap();
}

#[test]
fn a_bomb_stops_at_the_stream_bound() {
    let tar = tar_of(&[("zeros", &vec![0u8; 1 << 20])]);
    let blob = gzip(&tar);
    assert!(blob.len() < 10_000, "a bomb: {} bytes", blob.len());
    let err = apply(&blob, Compression::Gzip, Digest::of(&tar), 64 * 1024).unwrap_err();
    assert!(format!("{err:?}").contains("TooLarge"), "{err:?}");
}

#[test]
fn a_huge_long_name_entry_is_refused_before_it_is_read() {
    // A GNU long-name header announcing 64 MiB of name.
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::GNULongName);
    h.as_gnu_mut().unwrap().name[..13].copy_from_slice(b"././@LongLink");
    h.set_size(64 << 20);
    h.set_cksum();
    let mut tar = h.as_bytes().to_vec();
    tar.extend(std::iter::repeat_n(b'a', 2 << 20));
    let err = apply(&gzip(&tar), Compression::Gzip, Digest::of(&tar), 1 << 30).unwrap_err();
    assert!(format!("{err:?}").contains("MetaTooLarge"), "{err:?}");
}

#[test]
fn a_pax_size_is_followed_like_the_tar_reader_does() {
    let mut b = tar::Builder::new(Vec::new());
    // A PAX header carrying a size for the next entry, whose own size field says 0.
    let record = b"15 size=100000\n";
    let mut pax = tar::Header::new_ustar();
    pax.set_entry_type(tar::EntryType::XHeader);
    pax.set_size(record.len() as u64);
    pax.set_cksum();
    b.append(&pax, &record[..]).unwrap();
    let mut file = tar::Header::new_ustar();
    file.set_path("big").unwrap();
    file.set_size(0);
    file.set_uid(0);
    file.set_gid(0);
    file.set_mode(0o644);
    file.set_cksum();
    let data = vec![b'L'; 100_000];
    b.append(&file, data.as_slice()).unwrap();
    let tar = b.into_inner().unwrap();
    apply(&tar, Compression::None, Digest::of(&tar), 1 << 20).unwrap();
}

#[test]
fn more_than_padding_after_the_end_is_refused() {
    let mut tar = tar_of(&[("a", b"x")]);
    tar.extend(vec![1u8; 2 << 20]);
    let err = apply(&tar, Compression::None, Digest::of(&tar), 1 << 30).unwrap_err();
    assert!(format!("{err:?}").contains("Trailer"), "{err:?}");
}

#[test]
fn header_sizes_in_octal_and_base_256() {
    assert_eq!(header_size(b"00000000012\0"), Some(10));
    assert_eq!(header_size(b"           \0"), Some(0));
    let mut b256 = [0u8; 12];
    b256[0] = 0x80;
    b256[11] = 5;
    assert_eq!(header_size(&b256), Some(5));
    assert_eq!(header_size(b"zz\0\0\0\0\0\0\0\0\0\0"), None);
    assert_eq!(pax_size(b"15 size=100000\n19 path=some/name\n"), Some(100_000));
}

proptest::proptest! {
    /// Any bytes through the framing watch and a decoder: an error or a stream, never a panic.
    #[test]
    fn arbitrary_streams_never_panic(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..4096)) {
        let mut frame = Frame::default();
        let _ = frame.watch(&bytes);
        let mut out = Vec::new();
        let _ = ZstdFrames::new(bytes.as_slice()).take(1 << 20).read_to_end(&mut out);
    }
}
