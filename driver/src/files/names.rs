//! What a tar entry's name and link target may be, decided on bytes alone before anything is touched.
//!
//! An entry lands at `top/REST` in the staging directory, where `top` stands for the tar's one top-level
//! name. So a name is a list of plain components: never absolute, never `..`, and always under the first
//! entry's top-level name. A symlink's target may climb with leading `..` components, never above `top`,
//! and then only descend: every symlink the extractor makes then resolves inside the copied tree, whatever
//! the other symlinks in it are (a `..` after a symlink component would climb from wherever that symlink
//! points, which bytes alone cannot tell).

use vm_protocol::files::TarRefusal;

/// A checked entry name: its components below the top-level name.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct EntryName {
    /// The components under the top-level name (empty for the top itself).
    pub below_top: Vec<Vec<u8>>,
}

/// Splits and checks an entry name (or a hard link's target, which names an entry of the same tar).
/// `top` is the tar's top-level name, set by its first entry.
///
/// # Errors
/// The [`TarRefusal`] that names what is wrong.
pub fn entry_name(raw: &[u8], top: &mut Option<Vec<u8>>, max_bytes: usize) -> Result<EntryName, TarRefusal> {
    if raw.len() > max_bytes {
        return Err(TarRefusal::PathTooLong);
    }
    if raw.first() == Some(&b'/') {
        return Err(TarRefusal::AbsolutePath);
    }
    if raw.contains(&0) {
        return Err(TarRefusal::Malformed);
    }
    let mut parts = Vec::new();
    for part in raw.split(|b| *b == b'/') {
        match part {
            b"" | b"." => {}
            b".." => return Err(TarRefusal::ParentDir),
            name => parts.push(name.to_vec()),
        }
    }
    let Some((first, rest)) = parts.split_first() else { return Err(TarRefusal::Malformed) };
    match top {
        Some(top) if top != first => return Err(TarRefusal::Duplicate),
        Some(_) => {}
        None => *top = Some(first.clone()),
    }
    Ok(EntryName { below_top: rest.to_vec() })
}

/// Checks a symlink target for a link at `name` (depth: its components below the top-level name).
///
/// # Errors
/// An absolute target, one that climbs above the top-level name or climbs after descending, or one too long.
pub fn symlink_target(target: &[u8], name: &EntryName, max_bytes: usize) -> Result<(), TarRefusal> {
    if target.len() > max_bytes {
        return Err(TarRefusal::PathTooLong);
    }
    if target.is_empty() || target.contains(&0) {
        return Err(TarRefusal::Malformed);
    }
    if target.first() == Some(&b'/') {
        return Err(TarRefusal::AbsolutePath);
    }
    // A top-level symlink sits in the destination's directory, outside the copied tree: it may point nowhere.
    let Some(mut climbable) = name.below_top.len().checked_sub(1) else { return Err(TarRefusal::ParentDir) };
    // The link's own directory is `top/below_top[..len - 1]`: that many `..` reach `top`.
    let mut descended = false;
    for part in target.split(|b| *b == b'/') {
        match part {
            b"" | b"." => {}
            b".." if descended || climbable == 0 => return Err(TarRefusal::ParentDir),
            b".." => climbable -= 1,
            _ => descended = true,
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn name(raw: &str) -> Result<EntryName, TarRefusal> {
        entry_name(raw.as_bytes(), &mut Some(b"out".to_vec()), 4096)
    }

    #[test]
    fn names_stay_under_the_one_top_level_name() {
        assert_eq!(name("out/a/./b/").unwrap().below_top, vec![b"a".to_vec(), b"b".to_vec()]);
        assert_eq!(name("./out").unwrap().below_top, Vec::<Vec<u8>>::new());
        assert_eq!(name("/etc/passwd"), Err(TarRefusal::AbsolutePath));
        assert_eq!(name("out/../../x"), Err(TarRefusal::ParentDir));
        assert_eq!(name("other/x"), Err(TarRefusal::Duplicate));
        assert_eq!(name("./"), Err(TarRefusal::Malformed));
        assert_eq!(entry_name(&[b'a'; 5000], &mut None, 4096), Err(TarRefusal::PathTooLong));
        let mut top = None;
        assert!(entry_name(b"first/x", &mut top, 4096).is_ok());
        assert_eq!(top.as_deref(), Some(&b"first"[..]));
    }

    #[test]
    fn symlinks_climb_only_first_and_never_above_the_top() {
        let at = |raw: &str| name(raw).unwrap();
        assert_eq!(symlink_target(b"b/c", &at("out/a"), 4096), Ok(()));
        assert_eq!(symlink_target(b"../x", &at("out/d/a"), 4096), Ok(()));
        assert_eq!(symlink_target(b".", &at("out/a"), 4096), Ok(()));
        assert_eq!(symlink_target(b"..", &at("out/a"), 4096), Err(TarRefusal::ParentDir));
        assert_eq!(symlink_target(b"../../x", &at("out/d/a"), 4096), Err(TarRefusal::ParentDir));
        // Climbing after a component: that component may be a symlink to the top itself.
        assert_eq!(symlink_target(b"b/..", &at("out/a"), 4096), Err(TarRefusal::ParentDir));
        assert_eq!(symlink_target(b"/etc", &at("out/a"), 4096), Err(TarRefusal::AbsolutePath));
        assert_eq!(symlink_target(b"", &at("out/a"), 4096), Err(TarRefusal::Malformed));
        assert_eq!(symlink_target(b"x", &at("out"), 4096), Err(TarRefusal::ParentDir));
    }

    proptest! {
        /// Whatever the bytes, a checked name has only plain components: no panic, no way up.
        #[test]
        fn a_checked_name_never_holds_a_way_up(raw in prop::collection::vec(prop::sample::select(b"ab./\0".to_vec()), 0..40)) {
            let mut top = None;
            if let Ok(checked) = entry_name(&raw, &mut top, 4096) {
                for part in checked.below_top.iter().chain(top.iter()) {
                    prop_assert!(!part.is_empty() && part != b"." && part != b".." && !part.contains(&b'/'));
                }
            }
        }

        /// An accepted symlink target, resolved lexically from its link's directory, stays under the top.
        #[test]
        fn an_accepted_target_stays_under_the_top(
            depth in 1usize..5,
            target in prop::collection::vec(prop::sample::select(vec!["..", "a", ".", ""]), 1..8),
        ) {
            let link = EntryName { below_top: vec![b"d".to_vec(); depth] };
            let target = target.join("/");
            if symlink_target(target.as_bytes(), &link, 4096).is_ok() {
                let mut level = i64::try_from(depth).unwrap() - 1;
                for part in target.split('/') {
                    if part == ".." { level -= 1; } else if part == "a" { level += 1; }
                    prop_assert!(level >= 0, "{target} from depth {depth}");
                }
            }
        }
    }
}
