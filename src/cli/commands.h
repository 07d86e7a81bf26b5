/* commands.h — the subcommands of the deltaserve executable.
 *
 * main() picks the command by argv[1] and calls it with argv shifted by one: argv[0] is the
 * command's name ("generate"), flags follow (parse them with ds_args_parse_cli from args.h).
 * A command returns the process exit status: 0 on success (and after --help), 1 when the work
 * failed (bad model folder, I/O error), 2 for a usage error (unknown flag, bad value). */
#ifndef DS_COMMANDS_H
#define DS_COMMANDS_H

int ds_cmd_serve(int argc, char **argv);       /* OpenAI-compatible HTTP server */
int ds_cmd_generate(int argc, char **argv);    /* complete a prompt, print the text */
int ds_cmd_logits(int argc, char **argv);      /* print / dump the logits of a prompt */
int ds_cmd_bench(int argc, char **argv);       /* throughput against the machine's limits */
int ds_cmd_bench_serve(int argc, char **argv); /* load generator against a running server */
int ds_cmd_tokenize(int argc, char **argv);    /* text -> ids, ids -> text */
int ds_cmd_init_model(int argc, char **argv);  /* write a random checkpoint from a preset */

#endif
