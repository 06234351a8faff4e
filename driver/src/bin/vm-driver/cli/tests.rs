use clap::Parser;

use super::{Cli, Command};
use crate::image::ImageCommand;

fn parse(argv: &[&str]) -> Command {
    Cli::try_parse_from(std::iter::once("vm-driver").chain(argv.iter().copied())).unwrap().command
}

#[test]
fn the_aliases_docker_and_kubectl_users_type_name_the_same_commands() {
    assert!(matches!(parse(&["ls"]), Command::List(_)));
    assert!(matches!(parse(&["list"]), Command::List(_)));
    assert!(matches!(parse(&["delete", "box"]), Command::Rm(_)));
    assert!(matches!(parse(&["image", "list"]), Command::Image(a) if matches!(a.command, ImageCommand::Ls)));
    // And they are shown.
    let help = <Cli as clap::CommandFactory>::command().render_help().to_string();
    assert!(help.contains("[alias: ls]") && help.contains("[alias: delete]"), "{help}");
}

#[test]
fn start_waits_as_create_does_unless_told_not_to() {
    let Command::Start(start) = parse(&["start", "box"]) else { panic!("start") };
    let Command::Create(create) = parse(&["create", "box"]) else { panic!("create") };
    assert!(!start.wait.no_wait && !create.wait.no_wait);
    assert_eq!(start.wait.wait_timeout, create.wait.wait_timeout, "the same default");
    assert_eq!(start.sandbox.id.as_str(), "box");
    let Command::Start(start) = parse(&["start", "--no-wait", "--wait-timeout", "5", "box"]) else { panic!("start") };
    assert!(start.wait.no_wait);
    assert_eq!(start.wait.wait_timeout, 5);
}
